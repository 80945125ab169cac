"""The compiled decode path: inductor-compiled layer regions inside the engine's manual CUDA graph.

Why this design (issue 17): the manual CUDA graph of the eager step (``hf_graphs``) removes launch overhead but
still runs every small kernel of attention, RoPE and the RMS norms one by one (H200, Qwen3-30B-A3B shapes:
9.81 ms at B=1 against 5.48 ms for ``torch.compile(mode="reduce-overhead")`` of the whole model with the fused
MoE kernel). Compiling the whole model costs 70–95 s per shape and traces the SERE hooks; this module compiles
**regions** instead — every RMS norm of the text model (input, post-attention, q, k, final), each router's
``forward`` (its SERE hooks stay outside, in eager Python), the rotary embedding and the RoPE function
``apply_rotary_pos_emb`` — with ``dynamic=False``. All 48 layers share one compiled code object per region (``inline_inbuilt_nn_modules``: the
parameters are graph inputs, not constants), so the compile cost is one layer's, not 48. The attention module as a
whole is not a region: its forward reads ``self.layer_idx`` (which KV-cache layer to update), an int dynamo
specialises on, so it would compile once per layer (measured: one more graph per layer); its projections, the cache
update and sdpa stay eager (a handful of large kernels). The fused MoE kernel
(``torch.ops.harness.fused_moe``) and SERE's Triton op run as they are. The engine's ``StaticGreedyDecoder`` then
captures the whole step — compiled regions, router hooks, MoE kernel, argmax, feed-back — in one CUDA graph, as
for the eager step; so the SERE statistics bookkeeping of ``hf_graphs`` is unchanged.

Regions run compiled only inside :func:`decoding` (the decoder's decode steps, fixed shapes); a prefill or any
other call runs the original eager code, so prompts of any length never trigger a compilation.

Compile artefacts are cached across runs: ``TORCHINDUCTOR_CACHE_DIR`` is set to ``$HARNESS_INDUCTOR_CACHE`` or
``$HARNESS_CACHE/inductor`` before the first compilation (FX-graph and autotuning caches).
Only torch is imported.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import torch

from harness.config.paths import cache_path

__all__ = ["compile_regions", "decoding", "is_decoding", "CompileInfo"]

_DECODING = [False]


def is_decoding() -> bool:
    return _DECODING[0]


@contextlib.contextmanager
def decoding():
    """Inside: the compiled regions run (decode steps). Outside: the original eager forwards."""
    prev = _DECODING[0]
    _DECODING[0] = True
    try:
        yield
    finally:
        _DECODING[0] = prev


class CompileInfo(dict):
    """What was compiled (``regions``), how (``mode``, ``backend``) and the inductor cache directory."""


def _cache_dir() -> str:
    # torch sets TORCHINDUCTOR_CACHE_DIR to /tmp/torchinductor_<user> itself when it is unset, so an inherited
    # value cannot be told from a chosen one: HARNESS_INDUCTOR_CACHE chooses, else $HARNESS_CACHE/inductor
    path = os.environ.get("HARNESS_INDUCTOR_CACHE") or cache_path("inductor")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.makedirs(path, exist_ok=True)
    return path


def _wrap(module: torch.nn.Module, compiled_kwargs: dict[str, Any]) -> None:
    """``module.forward`` → compiled while :func:`decoding`, the original otherwise (hooks stay in eager)."""
    if getattr(module, "_harness_compiled", False):
        return
    eager = module.forward
    compiled = torch.compile(eager, **compiled_kwargs)

    def forward(*args, **kwargs):
        return compiled(*args, **kwargs) if _DECODING[0] else eager(*args, **kwargs)

    module.forward = forward
    module._harness_compiled = True
    module._harness_eager_forward = eager


_REGION_KWARGS: list = [None]   # compile_regions' torch.compile settings, once it ran (None: regions are off)


def region(fn):
    """Decorator for a pure tensor function that should be one more compiled region: inside :func:`decoding`, after
    :func:`compile_regions` ran, it runs through ``torch.compile`` with the regions' settings (one compilation per
    settings, shared by every caller: tensors are arguments, so layers do not recompile); otherwise eagerly."""
    compiled: dict[str, Any] = {}

    def dispatch(*args, **kwargs):
        settings = _REGION_KWARGS[0]
        if not (_DECODING[0] and settings is not None):
            return fn(*args, **kwargs)
        key = repr(sorted(settings.items()))
        if key not in compiled:
            compiled[key] = torch.compile(fn, **settings)
        return compiled[key](*args, **kwargs)

    dispatch.__wrapped__ = fn
    dispatch.__doc__ = fn.__doc__
    return dispatch


def uncompile(model: torch.nn.Module) -> None:
    """Put every original ``forward`` (and RoPE function) back (the graph path after a failed compile)."""
    _REGION_KWARGS[0] = None
    while _PATCHED:
        mod, fn = _PATCHED.pop()
        mod.apply_rotary_pos_emb = fn
    for m in model.modules():
        if getattr(m, "_harness_compiled", False):
            m.forward = m._harness_eager_forward
            del m._harness_compiled, m._harness_eager_forward


def _regions(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(kind, module) of every region: every RMS norm of the text model (input / post-attention / q / k / final),
    each router, the text rotary embedding. The attention module itself is not a region: its forward reads
    ``self.layer_idx`` (the KV-cache layer), a Python int dynamo specialises on, which would compile it once per
    layer; its RoPE function is compiled instead (:func:`_patch_rope`)."""
    out = []
    for name, m in model.named_modules():
        if "visual" in name:
            continue
        if type(m).__name__.endswith("RMSNorm"):
            out.append(("norm", m))
        elif name.endswith("mlp.gate") and hasattr(m, "weight") and not getattr(m, "_harness_router_kernel", False):
            out.append(("router", m))
        elif name.endswith("rotary_emb"):
            out.append(("rotary", m))
    return out


def _patch_rope(model: torch.nn.Module, compiled_kwargs: dict[str, Any]) -> int:
    """Compile ``apply_rotary_pos_emb`` of the modeling modules the model's attention classes live in (looked up
    as a module global at call time, so the patched function is what attention calls)."""
    import sys

    n = 0
    for module_name in {type(m).__module__ for m in model.modules()}:
        mod = sys.modules.get(module_name)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None:
            continue
        if getattr(fn, "_harness_compiled", False):   # patched by an earlier model in this process: in effect
            n += 1
            continue
        compiled = torch.compile(fn, **compiled_kwargs)

        def rope(*args, _eager=fn, _compiled=compiled, **kwargs):
            return _compiled(*args, **kwargs) if _DECODING[0] else _eager(*args, **kwargs)

        rope._harness_compiled = True
        rope._harness_eager = fn
        setattr(mod, "apply_rotary_pos_emb", rope)
        _PATCHED.append((mod, fn))
        n += 1
    return n


_PATCHED: list = []


def compile_regions(model: torch.nn.Module, mode: str = "default", backend: str = "inductor") -> CompileInfo:
    """Wrap every region of ``model`` (see the module doc); compilation itself happens at the first decode step.

    ``mode``: inductor mode without CUDA graphs (``default`` | ``max-autotune-no-cudagraphs``); ``backend``:
    ``inductor`` | ``aot_eager`` (a CPU without a C++ compiler)."""
    import torch._dynamo as dynamo

    if mode not in ("default", "max-autotune-no-cudagraphs"):
        raise ValueError(f"compile mode {mode!r}: default | max-autotune-no-cudagraphs (the engine owns the graphs)")
    # one code object per region kind serves every layer, but batch sizes and SERE on/off add entries
    dynamo.config.cache_size_limit = max(dynamo.config.cache_size_limit, 64)
    if hasattr(dynamo.config, "accumulated_cache_size_limit"):
        dynamo.config.accumulated_cache_size_limit = max(dynamo.config.accumulated_cache_size_limit, 1024)
    kwargs: dict[str, Any] = {"backend": backend, "dynamic": False, "fullgraph": False}
    if backend == "inductor":
        kwargs["mode"] = mode
    cache = _cache_dir() if backend == "inductor" else None
    regions = _regions(model)
    if not regions:
        raise ValueError(f"no decoder layers found in {type(model).__name__} to compile")
    t0 = time.perf_counter()
    counts: dict[str, int] = {}
    for kind, module in regions:
        _wrap(module, kwargs)
        counts[kind] = counts.get(kind, 0) + 1
    counts["rope_function"] = _patch_rope(model, kwargs)
    _REGION_KWARGS[0] = dict(kwargs)
    return CompileInfo(regions=counts, mode=mode, backend=backend, inductor_cache_dir=cache,
                       wrap_s=round(time.perf_counter() - t0, 3))


def dynamo_counters() -> dict[str, Any]:
    """Graph breaks, unique graphs and recompilations so far (``summary.json`` engine_settings.compile)."""
    from torch._dynamo.utils import counters

    return {"graph_breaks": int(sum(counters["graph_break"].values())),
            "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "calls_captured": int(counters["stats"].get("calls_captured", 0))}
