"""What the benchmark scripts share: the command line, error and output helpers, timers, inputs, and the
Qwen3-30B-A3B-shaped decode model with its one-batch decoder.

Why one module: the scripts used to keep their own copies of these (``short_error``, the JSON + Markdown writer,
``rel_err``, ``sync``, three CUDA-graph captures, four timers, two shape dicts and a model builder beside
:mod:`harness.models.real_shapes`), or import them from one another (``bench_decode_attention`` and
``bench_router`` from ``bench_fused_moe``, the ``run_path_*`` scripts from ``bench_decode_step``). A script
imports this as a top-level module (``from _common import ...``): ``python benchmarks/<script>.py`` puts this
folder first on ``sys.path``. Importing it puts the repository root there too, so ``harness`` imports without
the package installed (the GPU machine runs a copy of the tree).

Only torch is imported at module level; triton, transformers and harness inside the functions that use them, so
a GPU benchmark runs with torch, triton and transformers alone (nothing here imports hydra, wandb or vllm).

What stays in the scripts, and why: timers that differ in what they measure — ``bench_routing_op.time_graphs``
(interleaved rounds of many replays of a graph of all layers), ``bench_importance.measure`` (FLOP/s, bandwidth
and peak memory around the shared ``do_bench``), ``run_path_gaps.timed`` (host wall time of one call, synced on
both sides); ``run_path_gaps.err`` (keeps 400 characters and the traceback); ``bench_routing_op.bootstrap_ci`` (its
twin is in ``bench_vllm_decode``, which this change does not touch); the offload family's formatters and writers
(their own protocol module, ``offload_protocol``, and ``<stem>.json`` outputs). ``Decoder`` is not the engine's
``StaticGreedyDecoder`` on purpose (see its docstring).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: where a benchmark's committed results live
RESULTS_DIR = ROOT / "results" / "benchmarks"


# ----------------------------------------------------------------------------------------- command line


def add_device_args(ap: argparse.ArgumentParser, smoke_help: str = "CPU, tiny shapes: the code path only") -> None:
    """``--smoke`` (the CPU code path at tiny shapes, to test the script itself) and ``--out``."""
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    ap.add_argument("--out", type=Path, default=None)


def use_cuda(args: argparse.Namespace, interpret: bool = False) -> bool | None:
    """True on CUDA, False for a ``--smoke`` run, None (after saying why) when there is nothing to run: without a
    GPU and without ``--smoke`` there is nothing meaningful to time, and the script exits 0. ``interpret``: a smoke
    run switches Triton's interpreter on (``TRITON_INTERPRET=1`` unless set; it counts only before triton is first
    imported), so the script's kernels run on the CPU."""
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: use --smoke for the CPU code path")
        return None
    if interpret and args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return cuda


def card_slug(device_name: str | None = None) -> str:
    """The card in a result file's default name (``h100``, ``h200``, ``a100``; ``cpu`` without a GPU): a run on
    one card must not overwrite another card's committed figures under a name that says the other card."""
    import re

    if device_name is None:
        device_name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    return words[0] if words else "gpu"


def results_path(name: str, smoke: bool) -> Path:
    """``results/benchmarks/<name>``, or the temp dir for a smoke run (a smoke run never overwrites a result)."""
    return (Path(tempfile.gettempdir()) if smoke else RESULTS_DIR) / name


# ------------------------------------------------------------------------------------ errors and memory


def short_error(exc: BaseException) -> str:
    """``Type: first line of the message`` (300 characters at most): what a result row records of a failure."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def free_memory(cuda: bool) -> None:
    """Wait for the device, then return cached blocks (a failed or finished case's graph pools) to the driver."""
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------ numbers


def rel_err(got: torch.Tensor, want: torch.Tensor, nan: float = float("nan")) -> float:
    """Relative Frobenius error ``|got - want| / |want|`` in float64; ``nan`` where ``got`` holds a NaN (a
    checker compares with ``<``, which a NaN or an infinity fails either way: ``bench_importance`` passes
    ``float("inf")``, what its JSON has always recorded). A zero ``want`` counts as 1e-30."""
    got = got.double()
    if torch.isnan(got).any():
        return nan
    want = want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------- output


def write_result(result: Mapping[str, Any], out: Path, markdown: Callable[[Any], str] | str | None = None, *,
                 indent: int = 2) -> None:
    """Write ``result`` as JSON to ``out`` and, with ``markdown`` (a function of the result, or the text), its report
    to ``out`` with the suffix ``.md``. Each file is replaced whole (written beside it, then renamed): the scripts
    rewrite after every case, and a run killed at its time limit keeps the previous complete file. Values JSON
    cannot hold are written as ``str``; ``indent`` is each script's own (its committed files keep their layout)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _replace(out, json.dumps(result, indent=indent, default=str))
    if markdown is not None:
        _replace(out.with_suffix(".md"), markdown(result) if callable(markdown) else markdown)


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------- timing


def sync(cuda: bool) -> None:
    """Wait for the device (a no-op on CPU)."""
    if cuda:
        torch.cuda.synchronize()


QUANTILES = (0.5, 0.1, 0.9)


def do_bench_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 100) -> tuple[float, float, float]:
    """(p50, p10, p90) ms of ``fn`` by ``triton.testing.do_bench``: CUDA events around every call, L2 flushed
    before each, so a call starts cold as it would with the rest of a model's layers in between."""
    from triton.testing import do_bench

    p50, p10, p90 = do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=list(QUANTILES), return_mode="median")
    return p50, p10, p90


class Timer:
    """One kernel call: ``do_bench`` quantiles in µs on CUDA; on CPU (smoke) ``cpu_calls`` host-timed calls, which
    only exercise the code (interpreter times mean nothing). Returns ``p50_us``, ``p10_us``, ``p90_us``."""

    def __init__(self, cuda: bool, warmup_ms: int = 25, rep_ms: int = 100, cpu_calls: int = 2):
        self.cuda, self.warmup_ms, self.rep_ms, self.cpu_calls = cuda, warmup_ms, rep_ms, cpu_calls

    def __call__(self, fn: Callable[[], object], rep_ms: int | None = None) -> dict[str, float]:
        if self.cuda:
            p50, p10, p90 = do_bench_ms(fn, self.warmup_ms, rep_ms or self.rep_ms)
            return {"p50_us": p50 * 1e3, "p10_us": p10 * 1e3, "p90_us": p90 * 1e3}
        times = []
        for _ in range(self.cpu_calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return {"p50_us": sorted(times)[len(times) // 2], "p10_us": min(times), "p90_us": max(times)}


def capture_graph(fn: Callable[[], object], calls: int = 1, warmup: int = 2,
                  before_capture: Callable[[], object] | None = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` consecutive ``fn()`` calls, after ``warmup`` eager calls on a side stream (the
    allocations and compilations a first call makes stay out of the graph). ``before_capture`` runs between the
    two (a decoder rewinds its cache there). The graph's ``capture_s`` attribute holds the seconds of the capture
    itself (``torch.cuda.graph``'s own synchronisation included)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    if before_capture is not None:
        before_capture()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.capture_s = time.perf_counter() - t0
    return graph


@dataclass
class CallTimes:
    """Per-call times of :func:`time_calls`, sorted (ms), and the wall-clock mean over the whole loop (ms)."""

    ms: list[float]
    wall_mean_ms: float

    @property
    def median(self) -> float:
        import statistics

        return statistics.median(self.ms)

    def quantile(self, f: float) -> float:
        """The ``f`` quantile as the scripts always read it: the sorted value at index ``int(f * n)``."""
        return self.ms[min(len(self.ms) - 1, int(f * len(self.ms)))]


def time_calls(fn: Callable[[], object], n: int, cuda: bool) -> CallTimes:
    """``n`` calls of ``fn``, each timed: a pair of CUDA events around it on CUDA (the device is synchronised
    before the first, so nothing queued earlier falls inside), ``perf_counter`` on CPU."""
    if cuda:
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / n
        times = [s.elapsed_time(e) for s, e in events]
    else:
        times = []
        t0 = time.perf_counter()
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        wall = (time.perf_counter() - t0) * 1e3 / n
    return CallTimes(sorted(times), wall)


def replay_times(step: Callable[[], object], steps: int, cuda: bool, warmup_replays: int = 3,
                 rewind: Callable[[], object] | None = None) -> tuple[CallTimes, float | None]:
    """A decode step as a manual CUDA graph: two eager warm-up steps, the capture, ``warmup_replays`` replays, then
    ``steps`` replays timed one by one (:func:`time_calls`); (times, capture seconds). ``rewind`` (a decoder's
    cache back to its prompt) runs before the warm-up, before the capture and before the replays; without it the
    cache position moves on through all of them. On CPU: one eager step, then ``steps`` eager steps timed (no
    capture: None)."""
    rewind = rewind or (lambda: None)
    rewind()
    if not cuda:
        step()
        rewind()
        return time_calls(step, steps, False), None
    graph = capture_graph(step, warmup=2, before_capture=rewind)
    rewind()
    for _ in range(warmup_replays):
        graph.replay()
    return time_calls(graph.replay, steps, True), graph.capture_s


def tpot_fields(times: CallTimes) -> dict[str, float]:
    """The decode-step fields of ``bench_decode_step`` / ``run_path_gaps`` rows: median TPOT, p10 / p90, the
    wall-clock mean and the step count."""
    return {"tpot_ms": times.median, "p10_ms": times.quantile(0.1), "p90_ms": times.quantile(0.9),
            "wall_mean_ms": times.wall_mean_ms, "steps": len(times.ms)}


# ------------------------------------------------------------------------------------------------- inputs


def similarity_of(vectors: torch.Tensor) -> torch.Tensor:
    """SERE's similarity as the benchmarks stand it in: ``1 - d / max d`` over pairwise L2 distances of per-expert
    vectors, 1 on the diagonal."""
    dist = torch.cdist(vectors, vectors)
    return (1.0 - dist / dist.max()).fill_diagonal_(1.0)


def random_similarity(num_experts: int, seed: int, dim: int = 64) -> torch.Tensor:
    """:func:`similarity_of` random N(0, 1) ``dim``-d expert vectors (seeded; CPU)."""
    g = torch.Generator().manual_seed(seed)
    return similarity_of(torch.randn(num_experts, dim, generator=g))


def random_similarities(layers: int, num_experts: int, device: str, seed: int) -> list[torch.Tensor]:
    """One :func:`similarity_of` random 64-d vectors per layer, all drawn from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [similarity_of(torch.randn(num_experts, 64, generator=g)).to(device) for _ in range(layers)]


# ------------------------------------------------------------------ the Qwen3-30B-A3B-shaped decode model

#: the smoke runs' text model (CPU: the code path only); the real run uses the checkpoint's shapes
TINY_TEXT: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=48,
                                 vocab_size=2048)
PROMPT = 64        # tokens prefilled once per batch
MAX_CACHE = 128    # StaticCache positions


def qwen3_moe_config(smoke: bool) -> dict[str, Any]:
    """The ``config.json``-like dict of :func:`harness.models.real_shapes.shapes_config` for Qwen3-30B-A3B (48
    layers, 128 experts, top-8, ...; the checkpoint's rope theta and special ids), or 2 layers of
    :data:`TINY_TEXT` for a smoke run."""
    from harness.models.real_shapes import shapes_config

    return shapes_config("qwen3_30b_a3b", 2 if smoke else None, TINY_TEXT if smoke else None)


def text_shape(config: Mapping[str, Any]) -> dict[str, Any]:
    """The text-model sizes of a :func:`qwen3_moe_config` dict (its ``config.json`` keys minus architecture,
    special ids and rope): what a result's ``shape`` records."""
    from harness.models.real_shapes import QWEN3_30B_A3B_TEXT

    return {k: config[k] for k in [*QWEN3_30B_A3B_TEXT, "max_position_embeddings"] if k in config}


def build_qwen3_moe(config: Mapping[str, Any], device: str, dtype: torch.dtype, experts_implementation: str,
                    seed: int = 0) -> tuple[torch.nn.Module, float]:
    """(model, seconds): :func:`harness.models.real_shapes.build_shapes_model` of ``config`` on ``device`` (sdpa;
    weights N(0, 0.02) drawn on the device from ``seed``, norms 1 — the distribution of transformers' own init,
    ``initializer_range`` 0.02, which the benchmarks drew unseeded before), checked: every parameter on
    ``device`` in ``dtype``, the experts initialised (finite, not constant)."""
    from harness.models.real_shapes import build_shapes_model

    t0 = time.perf_counter()
    model = build_shapes_model(dict(config), device, dtype, experts_implementation, seed=seed)
    sync(device == "cuda")
    misplaced = [n for n, p in model.named_parameters()
                 if p.device.type != torch.device(device).type or p.dtype != dtype]
    if misplaced:
        raise RuntimeError(f"{len(misplaced)} parameters not {dtype} on {device}, e.g. {misplaced[:3]}")
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    if not (torch.isfinite(experts).all() and experts.float().std() > 0):
        raise RuntimeError("expert weights were not initialised (NaN/inf or constant)")
    return model, time.perf_counter() - t0


def set_impl(model: torch.nn.Module, impl: str) -> None:
    """``model.set_experts_implementation(impl)``, checked on every experts module."""
    model.set_experts_implementation(impl)
    got = {m.config._experts_implementation for m in model.modules() if hasattr(m, "gate_up_proj")}
    if got != {impl}:
        raise RuntimeError(f"set_experts_implementation({impl!r}) left {got}")


def reset_position(cache: Any, position: int) -> None:
    """Rewind every static layer's write position (in place: the tensors keep their static addresses)."""
    for layer in cache.layers:
        if not hasattr(layer, "cumulative_length"):
            continue
        if isinstance(layer.cumulative_length, torch.Tensor):
            layer.cumulative_length.fill_(position)
        else:
            layer.cumulative_length = position


class Decoder:
    """One batch of the stock HF decode step: its ``StaticCache`` (a random :data:`PROMPT`-token prompt prefilled
    once), its input buffer and the step (forward, argmax, feed-back).

    Not the engine's ``StaticGreedyDecoder``: this is the plain transformers step that ``bench_decode_step``
    captures as the baseline, and that ``run_path_gaps`` sets beside the engine's decoder (which it times too);
    every variant rewinds to the same prefix, which a generate loop does not."""

    def __init__(self, model: torch.nn.Module, batch: int, vocab: int, device: str, seed: int):
        from transformers import StaticCache

        self.model, self.batch, self.device = model, batch, device
        self.cache = StaticCache(config=model.config, max_cache_len=MAX_CACHE)
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, vocab, (batch, PROMPT), generator=g).to(device)
        with torch.inference_mode():
            out = model(input_ids=prompt, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.prefill_finite = bool(torch.isfinite(out.logits).all())
        self.first_ids = out.logits[:, -1].argmax(-1, keepdim=True).clone()
        self.ids = self.first_ids.clone()
        del out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1]

    def step(self) -> None:
        """Eager step with greedy feed-back (what the manual CUDA graph captures)."""
        logits = self.forward(self.ids)
        self.ids.copy_(logits.argmax(-1, keepdim=True))

    def rewind(self) -> None:
        reset_position(self.cache, PROMPT)
        self.ids.copy_(self.first_ids)


def time_steps(run_step: Callable[[], object], steps: int, cuda: bool) -> dict[str, float]:
    """:func:`tpot_fields` of ``steps`` timed calls of ``run_step`` (CUDA events; CPU: host times)."""
    return tpot_fields(time_calls(run_step, steps, cuda))


def run_graph(dec: Decoder, steps: int, warmup: int, cuda: bool) -> dict[str, float]:
    """``dec``'s step as a manual CUDA graph, every phase from the same prefix (:func:`replay_times` with the
    decoder's rewind): ``capture_s`` and the :func:`tpot_fields`. CPU smoke: the eager step itself."""
    with torch.inference_mode():
        times, capture_s = replay_times(dec.step, steps, cuda, warmup, rewind=dec.rewind)
    return {**({"capture_s": capture_s} if capture_s is not None else {}), **tpot_fields(times)}


_SERE_OP: Any = None


def sere_op() -> Callable[..., torch.Tensor]:
    """``harness_bench::sere_reroute``: ``reroute_op`` behind a ``torch.library`` custom op (one opaque node for
    dynamo, CUDA-graph safe), called as ``hf_sere`` calls its op: ``op(ids, sim, k_primary, rho, protected,
    row_mask)``. Registered once per process (``bench_decode_step`` and ``run_path_gaps`` share it)."""
    global _SERE_OP
    if _SERE_OP is None:
        from harness.kernels.reroute import reroute_op

        @torch.library.custom_op("harness_bench::sere_reroute", mutates_args=())
        def _op(ids: torch.Tensor, similarity: torch.Tensor, k_primary: int, rho: float,
                protected: Optional[torch.Tensor] = None, row_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
            return reroute_op(ids, similarity, k_primary, rho, protected, row_mask)     # always a new tensor

        @_op.register_fake
        def _(ids, similarity, k_primary, rho, protected=None, row_mask=None):
            return torch.empty_like(ids)

        _SERE_OP = _op
    return lambda ids, sim, kp, rho, protected=None, row_mask=None: _SERE_OP(ids, sim, kp, float(rho), protected,
                                                                             row_mask)

