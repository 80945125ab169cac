"""SERE's one-launch statistics kernel equals the torch statistics value for value (Triton's interpreter on
CPU), and the engine's per-layer statistics cost one launch, not ~44 ops (docs/latency.md, "Run path vs
benchmark scripts")."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness.engines.hf.sere import COUNTERS, SereHandle, _Layer
from harness.kernels.reroute import reroute_op

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (T, E, k): one row, odd T, T above one 64-row tile and one 128-slot tile; E of one and several words
SHAPES = [(1, 16, 4), (7, 16, 8), (70, 16, 8), (1, 128, 8), (33, 128, 8), (5, 100, 6)]


def case(t, e, k, kp, seed, with_live, with_prot, invalid):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(t, e, generator=g).topk(k).indices
    if invalid:  # -1 = "no expert", and an id beyond E: neither counts anywhere
        ids[0, -1] = -1
        ids[t // 2, 0] = e + 3
    sim = torch.rand(e, e, generator=g)
    sim = (sim + sim.T) / 2
    sim.fill_diagonal_(1.0)
    prot = (torch.rand(e, generator=g) < 0.3) if with_prot else None
    live = (torch.rand(t, generator=g) < 0.7) if with_live else None
    new = reroute_op(ids, sim, kp, 0.4, prot, live)
    dev = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return dev(ids), dev(new), dev(live), dev(prot)


@pytest.fixture(autouse=True)
def _auto_takes_the_kernel_under_the_interpreter(monkeypatch):
    """These tests check the kernel: "auto" takes it under the interpreter here (off by default on CPU)."""
    import harness.engines.hf.routing as hf_routing  # the hook mechanism SERE stands on reads the flag there

    monkeypatch.setattr(hf_routing, "INTERPRETER_AUTO", True)


def record(impl, kp, e, passes):
    handle = SereHandle(kp, 0.4, "decode", True, None)
    handle.stats_impl = impl
    st = _Layer(0, None, None, e, None, None)
    for ids, new, live, prot in passes:
        st.protected = prot
        handle._record(st, ids, new, live)
    return st


@pytest.mark.parametrize("invalid", [False, True])
@pytest.mark.parametrize("with_prot", [False, True])
@pytest.mark.parametrize("with_live", [False, True])
@pytest.mark.parametrize("kp", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}".format(*s))
def test_fused_equals_torch(shape, kp, with_live, with_prot, invalid):
    t, e, k = shape
    # two passes of the same T (accumulation) and one of another T (a second histogram)
    passes = [case(t, e, k, kp, seed, with_live, with_prot, invalid) for seed in (1, 2)]
    passes.append(case(t + 2, e, k, kp, 3, with_live, with_prot, invalid))
    want, got = record("torch", kp, e, passes), record("fused", kp, e, passes)
    assert got.acc.tolist() == want.acc.tolist(), dict(zip(COUNTERS, zip(got.acc.tolist(), want.acc.tolist())))
    assert sorted(got.by_batch) == sorted(want.by_batch)
    for n, (steps, hist) in want.by_batch.items():
        assert got.by_batch[n][0] == steps
        assert torch.equal(got.by_batch[n][1], hist), (n, got.by_batch[n][1], hist)
    assert (got.steps, got.tokens, got.secondary_slots) == (want.steps, want.tokens, want.secondary_slots)


def test_cases_are_not_vacuous():
    """The grid above moves slots, keeps some outside P, and hits protected experts."""
    st = record("torch", 2, 16, [case(7, 16, 8, 2, 1, True, True, False)])
    before, after, prim, moved, outside, critical, prot_hits, rows = st.acc.tolist()
    assert moved > 0 and outside > 0 and prot_hits > 0 and 0 < rows < 7 and after < before


class _Ops(TorchDispatchMode):
    """The aten ops a block of code dispatches (views and scalar wrapping left out)."""

    SKIP = {"view", "slice", "reshape", "_reshape_alias", "alias", "select", "unsqueeze", "expand", "t",
            "as_strided", "_unsafe_view", "detach", "scalar_tensor"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in self.SKIP:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_statistics_of_a_layer_are_one_launch(monkeypatch):
    """The engine's decode step pays its statistics once per layer: with the fused path no torch op at all runs
    per layer and step (the kernel launch is the only work), where the torch path dispatched ~44 ops (≈2,000
    kernels per step at 48 layers, ~3.5 ms of a 20 ms H200 step). Counted with the launch itself stubbed: what
    is left is what a CUDA graph would capture besides it."""
    import harness.kernels.sere_stats as stats_mod

    launches = []
    monkeypatch.setattr(stats_mod, "_stats_kernel", type("K", (), {
        "__getitem__": lambda self, grid: (lambda *a, **kw: launches.append(grid))})())
    ids, new, live, prot = case(16, 128, 8, 2, 0, True, True, False)
    for impl, limit in (("fused", 0), ("torch", None)):
        handle = SereHandle(2, 0.4, "decode", True, None)
        handle.stats_impl = impl
        st = _Layer(0, None, None, 128, None, prot)
        handle._record(st, ids, new, live)       # the first pass builds the counters
        with _Ops() as seen:
            handle._record(st, ids, new, live)
        if limit is not None:
            assert seen.ops == [], seen.ops
        else:
            assert len(seen.ops) > 30              # the old path: what the fused kernel replaces
    assert launches == [(1,), (1,)]


def test_auto_uses_the_kernel_for_decode_sized_passes_only(monkeypatch):
    """``stats_impl="auto"``: the kernel for decode batches; a pass above FUSED_MAX_TOKENS rows keeps the torch ops."""
    import harness.kernels.sere_stats as stats_mod

    import harness.engines.hf.routing as hf_routing

    monkeypatch.setattr(stats_mod, "FUSED_MAX_TOKENS", 8)
    handle = SereHandle(2, 0.4, "all", True, None)
    small_cpu = torch.zeros(8, 4, dtype=torch.long)
    monkeypatch.setattr(hf_routing, "INTERPRETER_AUTO", False)
    assert not handle._fused_stats(small_cpu)             # CPU by default: the torch ops
    monkeypatch.setattr(hf_routing, "INTERPRETER_AUTO", True)
    small = torch.zeros(8, 4, dtype=torch.long, device=DEVICE)
    large = torch.zeros(9, 4, dtype=torch.long, device=DEVICE)
    assert handle._fused_stats(small) and not handle._fused_stats(large)
    handle.stats_impl = "torch"
    assert not handle._fused_stats(small)


def test_a_kernel_that_cannot_build_falls_back_to_the_same_counts(monkeypatch):
    """``auto``: a failing launch (e.g. a Triton build error on some GPU) warns once and counts with torch ops,
    the same values; ``fused`` (forced) raises."""
    import harness.kernels.sere_stats as stats_mod

    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    passes = [case(7, 16, 8, 2, 1, True, True, False)]
    want = record("torch", 2, 16, passes)
    monkeypatch.setattr(stats_mod, "record_stats", broken)
    with pytest.warns(RuntimeWarning, match="statistics kernel unavailable"):
        got = record("auto", 2, 16, passes)
    assert got.acc.tolist() == want.acc.tolist()
    with pytest.raises(RuntimeError, match="no compiler"):
        record("fused", 2, 16, passes)
