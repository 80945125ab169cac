"""``python -m harness.commands.offload_trace``: record a routing trace (or write a synthetic one).

Recorded (the default): the run's config is composed exactly as ``python -m harness`` does (same groups, same
overrides, same validation), the dataset's requests go through the HF engine (embedded model by default; any
``model=...``), and :class:`harness.techniques.offload.trace_record.TraceRecorder` keeps, per decode token and MoE layer,
the experts the experts module received (after ``moe.top_k`` / SERE when they are on) with their router
weights, plus the token's input embedding. CUDA graphs are turned off (a graph replay runs no hook)::

    python -m harness.commands.offload_trace --out traces/tiny_rag dataset.limit=16 generation.max_new_tokens=48
    python -m harness.commands.offload_trace --out traces/qwen model=qwen3_vl_30b_a3b dataset=ocrbench_sample

Synthetic (``--synthetic``): the skewed generator of :mod:`harness.techniques.offload.synthetic` (Qwen3-30B-A3B routing
shape by default)::

    python -m harness.commands.offload_trace --synthetic --out traces/synth --requests 64 --tokens 128

Either way ``OUT.pt`` + ``OUT.json`` (format: :mod:`harness.techniques.offload.trace`). Train the stability predictor on
it with ``python -m harness.techniques.offload.predictor train OUT.pt --out ARTIFACT``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from harness.datasets import load_samples
from harness.engines.base import Request
from harness.engines.hf.engine import HFEngine
from harness.models.load import resolve_model
from harness.results.envinfo import collect_environment
from harness.run.validate import validate_config

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def compose(overrides: list[str]) -> Any:
    """The experiment config for ``overrides`` (validated as ``python -m harness`` validates it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=overrides)
    GlobalHydra.instance().clear()
    validate_config(cfg)
    return cfg


def record(overrides: list[str], out: str, progress: bool = True) -> tuple[Path, dict[str, Any]]:
    """Run the configured requests through the HF engine with a :class:`TraceRecorder`; returns (path, meta)."""
    from omegaconf import OmegaConf

    from harness.techniques.offload.trace import save_trace
    from harness.techniques.offload.trace_record import TraceRecorder

    cfg = compose([*overrides, "engine.name=hf", "engine.cuda_graphs=false"])
    if cfg.offload.policy is not None:
        raise SystemExit("offload_trace records the model's own routing: leave offload.policy unset")
    model_path, model_info = resolve_model(cfg.model)
    samples = [s for s in load_samples(cfg.dataset) if not getattr(s, "error", None)]
    requests = [Request(s.uid, s.content, s.load_images()) for s in samples]
    if not requests:
        raise SystemExit(f"dataset {cfg.dataset.name!r} produced no request")
    engine = HFEngine(model_path, cfg.engine, cfg.generation, trust_remote_code=cfg.model.trust_remote_code,
                      sere_cfg=cfg.sere, visionzip_cfg=cfg.visionzip, model_id=model_info["name"], moe_cfg=cfg.moe)
    bs = max(1, cfg.engine.batch_size)
    batches = [requests[i:i + bs] for i in range(0, len(requests), bs)]
    it = batches
    if progress:
        from tqdm import tqdm

        it = tqdm(batches, desc="trace", unit="batch", file=sys.stderr)
    errors = 0
    with TraceRecorder(engine.model, eos_token_ids=sorted(engine.eos_ids)) as rec:
        for batch in it:
            errors += sum(1 for g in engine.generate_batch(batch) if g.error)
        env = collect_environment(engine.device)
        meta = {"model": model_info, "dataset": OmegaConf.to_container(cfg.dataset, resolve=True),
                "seed": cfg.seed, "engine": engine.describe(), "environment": env,
                "generation": OmegaConf.to_container(cfg.generation, resolve=True),
                "techniques": {"sere_k": cfg.sere.k, "moe_top_k": cfg.moe.top_k, "visionzip_keep": cfg.visionzip.keep},
                "batch_size": bs, "requests_sent": len(requests), "failed_requests": errors,
                "uids": [r.uid for r in requests], "weights": model_info.get("weights"), "overrides": overrides}
        trace = rec.trace(meta)
    engine.close()
    return save_trace(trace, out), trace.meta


def synthetic(args: argparse.Namespace) -> tuple[Path, dict[str, Any]]:
    from harness.techniques.offload.synthetic import SyntheticSpec, reuse_statistics, synthetic_trace
    from harness.techniques.offload.trace import save_trace

    spec = SyntheticSpec(num_layers=args.layers, num_experts=args.experts, top_k=args.top_k, hidden=args.hidden,
                         requests=args.requests, tokens=args.tokens, seed=args.seed)
    trace = synthetic_trace(spec)
    trace.meta["reuse_statistics"] = reuse_statistics(trace, lru_layers=min(8, spec.num_layers))
    return save_trace(trace, args.out), trace.meta


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.commands.offload_trace", description=__doc__.split("\n")[0],
                                 epilog="Anything else on the command line is a Hydra override of the experiment "
                                        "config (model=..., dataset=..., dataset.limit=..., generation...).")
    ap.add_argument("--out", required=True, help="trace path (writes OUT.pt and OUT.json)")
    ap.add_argument("--synthetic", action="store_true", help="write a synthetic skewed trace instead of recording")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64, help="synthetic embedding width")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if o.startswith("--")]
    if bad:
        ap.error(f"unknown option(s) {bad}")
    if args.synthetic:
        if overrides:
            ap.error(f"--synthetic takes no config overrides (got {overrides})")
        path, meta = synthetic(args)
        rs = meta["reuse_statistics"]
        print(f"wrote {path}: {meta['num_tokens'] if 'num_tokens' in meta else ''} synthetic tokens; reuse distance "
              f"median {rs['reuse_distance']['median']:.0f}, LRU hit rates "
              + ", ".join(f"{x['residency']:.0%}: {x['hit_rate']:.3f}" for x in rs["lru"]))
        return 0
    path, meta = record(overrides, args.out)
    print(f"wrote {path}: {meta.get('requests_sent')} requests, {meta.get('failed_requests')} failed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
