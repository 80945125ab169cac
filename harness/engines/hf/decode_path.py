"""Which decode path and experts implementation an HF engine run takes, and why not another.

The HF engine decodes one of three ways (``engine.decode_path``): ``compiled`` (the compiled regions inside the
manual CUDA graph, :mod:`harness.engines.hf.compiled`), ``graph`` (the manual CUDA graph of the eager step,
:mod:`harness.engines.hf.graphs`) or ``eager`` (``model.generate``). :func:`resolve_decode_path` turns the request
(``auto`` included) into the path, and the ``*_reason`` functions say why a model or a run cannot take a graph
path (split over devices, eager attention, ``moe.routing=random_p``): that reason is what ``describe()`` reports
as ``decode_path_reason``. :func:`resolve_experts_implementation` picks the MoE experts kernel the same way.

Why a module of its own: these are pure decisions on the config, the device and the loaded model, with no
generation in them; :class:`harness.engines.hf.engine.HFEngine` applies them at load time, and tests and docs
point at them (``AUTO_CUDA_PATH`` is the one constant to change when the default path changes) without
reading through the engine.
"""

from __future__ import annotations


def resolve_experts_implementation(name: str | None, device: str) -> str | None:
    """``auto`` → the project's fused Triton MoE kernel on CUDA (its cost follows the active experts, so
    SERE's smaller union shows in TPOT), transformers' default elsewhere. Registers the kernel when chosen."""
    if name == "auto":
        name = "harness_fused_moe" if device.startswith("cuda") else None
    if name == "harness_fused_moe":
        from harness.engines.hf.experts import register

        register()
    return name


DECODE_PATHS = ("auto", "compiled", "graph", "eager")
#: what ``engine.decode_path=auto`` picks on CUDA (with ``engine.cuda_graphs``): the compiled regions inside the
#: manual graph (hf_compile). Measured against ``graph`` by benchmarks/run_path_table.sh: results/benchmarks/run_path.md.
AUTO_CUDA_PATH = "compiled"


def resolve_decode_path(requested: str, device: str, cuda_graphs: bool, split_reason: str | None = None,
                        ) -> tuple[str, str | None]:
    """(path, why it differs from the request or None). ``auto``: ``AUTO_CUDA_PATH`` on CUDA when
    ``engine.cuda_graphs`` is on, else ``eager`` (``model.generate``). A model split over devices by
    ``engine.device_map`` (``split_reason``) can only decode eagerly: a static graph cannot span accelerate's
    device hops; so can a model a graph cannot capture (:func:`capture_reason`), passed the same way."""
    if requested not in DECODE_PATHS:
        raise ValueError(f"engine.decode_path={requested!r}: expected one of {', '.join(DECODE_PATHS)}")
    path = requested
    if requested == "auto":
        path = AUTO_CUDA_PATH if device.startswith("cuda") and cuda_graphs else "eager"
    if path != "eager" and split_reason:
        return "eager", split_reason
    return path, None


def split_reason(model) -> str | None:
    """Why ``model`` (placed by accelerate) cannot run the static decoder: its parameters sit on several devices."""
    placement = getattr(model, "hf_device_map", None) or {}
    devices = {str(d) for d in placement.values()}
    if len(devices) > 1 or devices & {"disk"}:
        return f"engine.device_map placed the model on {sorted(devices)}: decoding eagerly (model.generate)"
    return None


def capture_reason(model) -> str | None:
    """Why ``model``'s decode step cannot be captured in a CUDA graph, or None. Eager attention (GPT-OSS needs it
    for its sinks): transformers' ``eager_mask`` builds ``torch.tensor(0.0, device=...)`` from a host scalar in
    every forward, a copy a graph capture refuses — the compiled and the graph path both failed on the H200
    (2026-12-03, GPT-OSS-20B shapes), so such a model decodes with ``model.generate``."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl == "eager":
        return ("eager attention: transformers builds its mask from a host scalar in every step, which a CUDA graph "
                "cannot capture: decoding eagerly (model.generate)")
    return None


def random_routing_reason(routing) -> str | None:
    """Why ``moe.routing=random_p`` decodes eagerly: its draws come from a generator re-seeded at every prefill
    (:mod:`harness.engines.hf.routing_baselines`), and a CUDA graph replays the offsets it captured instead of
    drawing again (a capture refuses such a generator: "Attempt to increase offset for a CUDA generator not in
    capture mode", H200, 2026-12-03). A quality baseline, so its decode time is not compared with SERE's."""
    if routing is not None and routing.routing == "random_p":
        return "moe.routing=random_p: its per-prefill seeded draws cannot be replayed by a CUDA graph: decoding eagerly"
    return None
