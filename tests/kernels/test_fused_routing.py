"""The routing op (harness.kernels.fused_routing): both launch plans — the one-program kernel and the
multi-program one (``fused_routing_multi``) — equal the torch reference (Triton's interpreter on CPU), and the
reference equals the composition of the algorithms it fuses — the stock top-k, ``moe.top_k``'s truncation +
padding and SERE's re-route — with the counters of the engines' statistics."""

from __future__ import annotations

import pytest
import torch

import harness.kernels.fused_routing as fused_routing_module
import harness.kernels.fused_routing_multi as fused_routing_multi_module
from harness.kernels.fused_routing import (COUNTERS, ONE_PROGRAM_MAX_TOKENS, RoutingSpec, fused_routing,
                                           fused_routing_reference, fused_routing_triton)
from harness.techniques.moe_topk import pad_routing, truncate_routing
from harness.techniques.sere.reroute import reroute

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(t: int, e: int, seed: int, dtype=torch.float32, levels: int = 4):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(t, e, generator=g) * 2).to(dtype)
    sim = torch.randint(0, levels + 1, (e, e), generator=g) / levels      # ties and values equal to rho
    sim.fill_diagonal_(1.0)
    sim[0, 1] = float("nan")
    protected = torch.rand(e, generator=g) < 0.2
    decode = torch.rand(t, generator=g) < 0.7
    real = torch.ones(t, dtype=torch.bool)
    real[-1:] = t < 2               # a padding row (when there are several)
    return [x.to(DEVICE) for x in (logits, sim, protected, decode, real)]


def composed(logits, spec: RoutingSpec, decode):
    """The same routing from the project's separate algorithms (the chain the vLLM plugin used to run)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    vals, ids = torch.topk(probs, spec.top_k, dim=-1)
    weights = vals / vals.sum(-1, keepdim=True) if spec.renormalize else vals
    weights = weights.to(logits.dtype)
    if spec.trunc_k is not None:
        rows = torch.ones_like(decode) if spec.trunc_all else decode
        w_k, ids_k = truncate_routing(logits, ids, spec.trunc_k, spec.renormalize)
        pw, pids = pad_routing(w_k, ids_k, spec.top_k)
        weights = torch.where(rows[:, None], pw, weights)
        ids = torch.where(rows[:, None], pids, ids)
    if spec.k_primary is not None:
        w = spec.width
        head = reroute(ids[:, :w].contiguous(), spec.similarity, spec.k_primary, spec.rho, spec.protected, decode)
        ids = torch.cat([head, ids[:, w:]], dim=1)
    return weights.float(), ids.int()


SPECS = {
    "stock": dict(),
    "stock-norenorm": dict(renormalize=False),
    "sere-k2": dict(k_primary=2, rho=0.0),
    "sere-k1-rho": dict(k_primary=1, rho=0.5, protect=True),
    "top2": dict(trunc_k=2),
    "top3-all": dict(trunc_k=3, trunc_all=True),
    "top4-sere-k2": dict(trunc_k=4, k_primary=2, rho=0.25, protect=True),
}


def spec_of(name, sim, protected, top_k=8):
    kw = dict(SPECS[name])
    protect = kw.pop("protect", False)
    renorm = kw.pop("renormalize", True)
    return RoutingSpec(top_k, renorm, similarity=sim if "k_primary" in kw else None,
                       protected=protected if protect else None, **kw)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_the_composed_algorithms(name, dtype):
    logits, sim, protected, decode, _ = make_case(37, 32, seed=3, dtype=dtype)
    spec = spec_of(name, sim, protected)
    w, ids = fused_routing_reference(logits, spec, decode)
    cw, cids = composed(logits, spec, decode)
    assert torch.equal(ids, cids)
    torch.testing.assert_close(w, cw, rtol=0, atol=0)


# (T, E): one tile (B=1, small batches), several tiles (the store/reload path), E not a power of two
SHAPES = [(1, 16), (5, 32), (16, 128), (70, 64), (9, 60)]
# the launch plans: the one-program kernel (several tiles beyond 16 rows: pass 2 reloads what pass 1 stored)
# and the multi-program one (T=1: one program; T=9: 5 programs of 2 rows; T=70: 5 of 16 rows, few enough for
# the interpreter; its default tiling at 70 rows is the next tests')
PLANS = {"one": lambda t: {"multi": False, "block_t": 16 if t > 16 else None},
         "multi": lambda t: {"multi": True, "block_t": 16 if t > 16 else None}}


def check_against_reference(logits, spec, decode, real, **kwargs):
    """The Triton op with ``kwargs`` gives the reference's ids exactly, its weights and both counters."""
    want_s = torch.zeros(len(COUNTERS), dtype=torch.long, device=DEVICE)
    want_k = torch.zeros_like(want_s)
    got_s, got_k = torch.zeros_like(want_s), torch.zeros_like(want_s)
    ww, wid = fused_routing_reference(logits, spec, decode, real, want_s, want_k)
    gw, gid = fused_routing_triton(logits, spec, decode, real, got_s, got_k, **kwargs)
    assert gid.dtype == torch.int32 and gw.dtype == torch.float32
    assert torch.equal(gid, wid), f"{kwargs}\n{gid}\n{wid}"
    torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-6)
    assert got_s.tolist() == want_s.tolist(), kwargs
    assert got_k.tolist() == want_k.tolist(), kwargs
    return want_s


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}".format(*s))
@pytest.mark.parametrize("plan", list(PLANS))
def test_kernel_matches_reference(plan, shape, name):
    t, e = shape
    logits, sim, protected, decode, real = make_case(t, e, seed=t * 131 + e)
    spec = spec_of(name, sim, protected, top_k=min(8, e // 2))
    check_against_reference(logits, spec, decode, real, **PLANS[plan](t))


def test_multi_program_plan_over_many_tiles():
    """P must hold the primary experts of the decode rows of every one of 19 tiles of 2 rows (one tile's P
    alone would move slots the reference keeps)."""
    logits, sim, protected, decode, real = make_case(37, 128, seed=17)
    spec = spec_of("top4-sere-k2", sim, protected)
    want_s = check_against_reference(logits, spec, decode, real, multi=True, block_t=2)
    assert want_s[COUNTERS.index("moved")] > 0


def test_multi_program_plan_takes_any_step_length(monkeypatch):
    """Steps beyond the one-program kernel's old 256-row limit (vLLM captures up to 512 tokens) run the
    Triton op, not the torch reference, and give the reference's routing; a step of many prefill rows and a
    few decode rows (a serving step) re-routes the decode rows only."""
    logits, sim, protected, decode, real = make_case(600, 16, seed=23)
    decode[:] = False
    decode[:5] = True
    spec = RoutingSpec(4, True, trunc_k=3, k_primary=1, rho=0.0, similarity=sim, protected=protected)
    want_s = torch.zeros(len(COUNTERS), dtype=torch.long, device=DEVICE)
    want_w, want_id = fused_routing_reference(logits, spec, decode, real, want_s)

    def refuse(*args, **kwargs):
        raise AssertionError("a Triton-sized step went to the torch reference")
    monkeypatch.setattr(fused_routing_module, "fused_routing_reference", refuse)
    got_s = torch.zeros_like(want_s)
    got_w, got_id = fused_routing(logits, spec, decode, real, got_s)
    assert torch.equal(got_id, want_id)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)
    assert got_s.tolist() == want_s.tolist() and got_s[COUNTERS.index("rows")] == 5


def _scratches():
    return list(fused_routing_multi_module._STEP_SCRATCH.values())


def test_multi_program_plan_leaves_its_scratch_zeroed_between_calls():
    """Top-K's counters go through a persistent scratch (no memset node in a CUDA graph): the step's expert
    sets, counted rows and arrivals. Each call's last program zeroes it, so calls of every spec and length in a
    row each give the reference's routing and counters — a word left over from the call before would put its
    experts or rows into the next counters (SERE's steps, between them, keep their own epoch-tagged words:
    tests/kernels/test_fused_routing_epoch.py)."""
    cases = [(9, 32, "top4-sere-k2", 2), (37, 32, "sere-k2", 4), (1, 32, "sere-k1-rho", None),
             (16, 32, "top2", 4), (9, 32, "top3-all", 2), (70, 32, "sere-k2", 16), (5, 32, "stock", 2)]
    for i, (t, e, name, block_t) in enumerate(cases * 2):
        logits, sim, protected, decode, real = make_case(t, e, seed=100 + i)
        decode[0] = True
        check_against_reference(logits, spec_of(name, sim, protected), decode, real, multi=True, block_t=block_t)
        assert all(int(b.abs().sum()) == 0 for b in _scratches()), f"call {i} ({name}, T={t}) left its scratch"


def test_multi_program_tile_taller_than_the_expert_block_finds_its_decode_rows():
    """SERE's re-route launch asks whether a tile has a decode row over a vector of max(experts block, rows)
    lanes: a 32-row tile of 16 experts whose decode rows are all past row 16 still re-routes them."""
    logits, sim, protected, decode, real = make_case(40, 16, seed=29)
    decode[:] = False
    decode[20:28] = True
    want_s = check_against_reference(logits, spec_of("sere-k2", sim, protected), decode, real, multi=True, block_t=32)
    assert want_s[COUNTERS.index("moved")] > 0


@pytest.mark.parametrize("name", [n for n in SPECS if "k_primary" in SPECS[n]])
@pytest.mark.parametrize("shape", [(1, 128), (4, 32), (8, 16)], ids=lambda s: "T{}-E{}".format(*s))
def test_both_reroutes_decide_alike(shape, name):
    """SERE's two one-tile re-routes — all secondary slots in one gather (small steps) and slot by slot —
    give the reference's ids and counters on the same case, whichever the size rule would pick."""
    t, e = shape
    logits, sim, protected, decode, real = make_case(t, e, seed=7 * t + e)
    decode[0] = True   # at least one decode row, so something can move
    spec = spec_of(name, sim, protected, top_k=8)
    want_s = torch.zeros(len(COUNTERS), dtype=torch.long, device=DEVICE)
    want_k = torch.zeros_like(want_s)
    _, wid = fused_routing_reference(logits, spec, decode, real, want_s, want_k)
    assert want_s[COUNTERS.index("moved")] > 0 or spec.rho > 0
    for cells in (0, 1 << 20):
        got_s, got_k = torch.zeros_like(want_s), torch.zeros_like(want_s)
        _, gid = fused_routing_triton(logits, spec, decode, real, got_s, got_k, vec_cells=cells)
        assert torch.equal(gid, wid), f"vec_cells={cells}\n{gid}\n{wid}"
        assert got_s.tolist() == want_s.tolist() and got_k.tolist() == want_k.tolist()


def test_counters_accumulate_and_count_what_moved():
    """Two calls add up; SERE moves slots and shrinks the union; top-K counts its padded slots as moved."""
    logits, sim, protected, decode, real = make_case(16, 32, seed=11)
    spec = RoutingSpec(8, True, trunc_k=4, k_primary=1, rho=0.0, similarity=sim)
    s = torch.zeros(len(COUNTERS), dtype=torch.long, device=DEVICE)
    k = torch.zeros_like(s)
    for _ in range(2):
        fused_routing(logits, spec, decode, real, s, k)
    c = dict(zip(COUNTERS, s.tolist()))
    n = int(decode.sum())
    assert c["calls"] == 2 and c["rows"] == 2 * n
    assert c["moved"] > 0 and c["after"] < c["before"]
    assert c["secondary"] == 2 * n * (4 - 1)
    kc = dict(zip(COUNTERS, k.tolist()))
    assert kc["rows"] == 2 * int((decode & real).sum()) and kc["moved"] == kc["rows"] * (8 - 4)
    assert kc["after"] <= kc["before"]


def test_no_decode_row_is_the_stock_routing():
    """A prefill step (no decode row): SERE and decode-scope truncation change nothing, count nothing."""
    logits, sim, protected, _, real = make_case(12, 32, seed=5)
    none = torch.zeros(12, dtype=torch.bool, device=DEVICE)
    stock = fused_routing(logits, RoutingSpec(8, True), none)
    s = torch.zeros(len(COUNTERS), dtype=torch.long, device=DEVICE)
    got = fused_routing(logits, RoutingSpec(8, True, trunc_k=2, k_primary=1, similarity=sim), none, real, s)
    assert torch.equal(got[1], stock[1]) and torch.equal(got[0], stock[0])
    assert s.tolist() == [0] * len(COUNTERS)


def test_spec_refuses_what_cannot_run():
    with pytest.raises(ValueError):
        RoutingSpec(8, True, k_primary=2)                       # SERE without a similarity
    with pytest.raises(ValueError):
        RoutingSpec(0, True)
    assert RoutingSpec(8, True, trunc_k=8).trunc_k is None        # K' >= k: no truncation
    assert RoutingSpec(8, True, trunc_k=2, k_primary=2, similarity=torch.eye(8)).k_primary is None


def test_custom_op_under_compile():
    """``torch.compile`` goes through the registered op (opaque, counters mutated) and gives the same routing."""
    logits, sim, protected, decode, real = make_case(6, 16, seed=2)
    spec = RoutingSpec(4, True, k_primary=1, rho=0.0, similarity=sim)
    eager_s = torch.zeros(len(COUNTERS), dtype=torch.long, device=DEVICE)
    want = fused_routing(logits, spec, decode, real, eager_s)

    comp_s = torch.zeros_like(eager_s)
    fn = torch.compile(lambda x: fused_routing(x, spec, decode, real, comp_s), backend="eager", fullgraph=True)
    got = fn(logits)
    assert torch.equal(got[1], want[1])
    assert comp_s.tolist() == eager_s.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_reference_is_capturable_in_a_cuda_graph():
    """The torch reference stays capturable (engines without Triton use it; before the multi-program plan,
    vLLM captured it for steps of more than 256 rows): it must not copy from the host (H200, vLLM 0.26: the
    SERE server died in capture), and replays must follow new logits."""
    logits, sim, protected, decode, real = make_case(300, 128, seed=5)
    spec = spec_of("top4-sere-k2", sim, protected)
    counters = torch.zeros(len(COUNTERS), dtype=torch.long, device=DEVICE)
    static = logits.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_routing_reference(static, spec, decode, real, counters.clone())   # warm-up off the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gid = fused_routing_reference(static, spec, decode, real, counters)
    fresh = logits.flip(0).contiguous()
    static.copy_(fresh)
    graph.replay()
    want_w, want_id = fused_routing_reference(fresh, spec, decode, real)
    assert torch.equal(gid, want_id)
    torch.testing.assert_close(gw, want_w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("t", [ONE_PROGRAM_MAX_TOKENS + 1, 70, 512])
def test_multi_program_plan_is_capturable_in_a_cuda_graph(t):
    """vLLM replays the op inside its CUDA graphs: SERE's launches (three with counters) and their persistent
    scratch are captured, replays follow new logits — each replay's P is its own step's, the epoch advancing on
    the device (``fused_routing_epoch``) — and each replay adds one call to the counters."""
    logits, sim, protected, decode, real = make_case(t, 128, seed=t)
    spec = spec_of("top4-sere-k2", sim, protected)
    counters = torch.zeros(len(COUNTERS), dtype=torch.long, device=DEVICE)
    static = logits.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_routing(static, spec, decode, real, counters.clone())   # warm-up (compilation) off the graph
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gid = fused_routing(static, spec, decode, real, counters)
    want_s = torch.zeros_like(counters)
    for fresh in (logits.flip(0).contiguous(), logits.roll(1, dims=1).contiguous()):
        static.copy_(fresh)
        graph.replay()
        want_w, want_id = fused_routing_reference(fresh, spec, decode, real, want_s)
        assert torch.equal(gid, want_id)
        torch.testing.assert_close(gw, want_w, rtol=1e-6, atol=1e-6)
    assert counters.tolist() == want_s.tolist() and counters[0] == 2


# --- DeepSeek-V3's rule (sigmoid + selection bias + group-limited top-k + scaling, float32 weights) -----------


def v3_spec(e: int, top_k: int, seed: int, renormalize: bool = True, **kw):
    g = torch.Generator().manual_seed(seed)
    bias = (torch.randn(e, generator=g) * 0.5).to(DEVICE)
    return RoutingSpec(top_k, renormalize, scoring="sigmoid", bias=bias, groups=4, topk_groups=2, scaling=2.5, **kw)


V3_SPECS = {
    "v3-stock": dict(),
    "v3-no-renorm": dict(renormalize=False),
    "v3-sere-k2": dict(k_primary=2, rho=0.0),
    "v3-top2": dict(trunc_k=2),
    "v3-top3-sere-k1": dict(trunc_k=3, k_primary=1, rho=0.25, protect=True),
}


def v3_case(name, t, e, seed, top_k=4):
    logits, sim, protected, decode, real = make_case(t, e, seed=seed)
    kw = dict(V3_SPECS[name])
    protect = kw.pop("protect", False)
    spec = v3_spec(e, top_k, seed, similarity=sim if "k_primary" in kw else None,
                   protected=protected if protect else None, **kw)
    return logits, spec, decode, real


@pytest.mark.parametrize("top_k", [1, 3])
def test_v3_reference_equals_the_deepseek_family_rule(top_k):
    """The reference's stock routing and its ``moe.top_k`` truncation = the DeepSeek-V3 family rule
    (``harness.models.families.deepseek.v3_rule``, itself tested against transformers' router)."""
    from types import SimpleNamespace

    from harness.models.families.deepseek import v3_rule

    logits, sim, protected, decode, real = make_case(23, 16, seed=9)
    rule = v3_rule(SimpleNamespace(norm_topk_prob=True, n_group=4, topk_group=2, routed_scaling_factor=2.5))
    spec = v3_spec(16, 4, seed=9)
    w, ids = fused_routing_reference(logits, spec)
    rw, rids = rule.stock(logits, 4, spec.bias)
    assert torch.equal(ids.long(), rids.long())
    torch.testing.assert_close(w, rw, rtol=0, atol=0)
    every = torch.ones(23, dtype=torch.bool, device=DEVICE)
    tw, tids = fused_routing_reference(logits, v3_spec(16, 4, seed=9, trunc_k=top_k), every)
    kw_, kids = rule.truncate(logits, rids, top_k, spec.bias)
    assert torch.equal(tids[:, :top_k].long(), kids.long()) and (tw[:, top_k:] == 0).all()
    torch.testing.assert_close(tw[:, :top_k], kw_, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(V3_SPECS))
@pytest.mark.parametrize("shape", [(1, 16), (6, 32), (40, 64)], ids=lambda s: "T{}-E{}".format(*s))
def test_v3_kernel_matches_reference(shape, name):
    t, e = shape
    logits, spec, decode, real = v3_case(name, t, e, seed=t * 17 + e)
    want_s = torch.zeros(len(COUNTERS), dtype=torch.long, device=DEVICE)
    want_k = torch.zeros_like(want_s)
    got_s, got_k = torch.zeros_like(want_s), torch.zeros_like(want_s)
    ww, wid = fused_routing_reference(logits, spec, decode, real, want_s, want_k)
    kwargs = {"block_t": 16} if t > 16 else {}
    gw, gid = fused_routing_triton(logits, spec, decode, real, got_s, got_k, **kwargs)
    assert torch.equal(gid, wid), f"\n{gid}\n{wid}"
    torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-6)
    assert got_s.tolist() == want_s.tolist() and got_k.tolist() == want_k.tolist()
    if name == "v3-stock":  # only the kept groups' experts are chosen, and the bias ranks without weighing
        groups = wid.long() // (e // 4)
        assert (torch.stack([(groups == g).any(1) for g in range(4)], 1).sum(1) <= 2).all()
        s = torch.sigmoid(logits.float()).gather(1, wid.long())
        torch.testing.assert_close(gw, s / s.sum(1, keepdim=True) * 2.5, rtol=1e-6, atol=1e-6)


def test_v3_spec_refusals():
    with pytest.raises(ValueError, match="sigmoid"):
        RoutingSpec(4, True, groups=4, topk_groups=2)             # groups with the softmax rule
    logits = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="groups"):
        fused_routing_reference(logits, v3_spec(16, 9, seed=0))   # top-9 of 2 groups x 4 experts
    with pytest.raises(ValueError, match="groups"):
        fused_routing_triton(logits, v3_spec(16, 9, seed=0))
