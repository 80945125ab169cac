"""Small-batch fused MoE path (``harness.kernels.fused_moe_small``) against the float32 reference and the
sorted path, and the dispatch between the two.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``), so
shapes stay tiny; H = 40 and I = 24 are not multiples of the interpreter's 16-wide tiles, so the column and
depth masks are exercised. Outputs and the ``act`` scratch are poisoned (NaN) so an element no kernel wrote
shows, and so does a read of an ``act`` row whose slot was invalid (never written).
"""

from __future__ import annotations

import math

import pytest
import torch
from test_fused_moe import rel_err, torch_bf16_moe   # the sorted path's helpers: the same error measures

from harness.kernels import fused_moe as fm
from harness.kernels import fused_moe_small as fms
from harness.kernels.fused_moe import fused_moe, fused_moe_triton, triton_available
from harness.kernels.fused_moe_reference import fused_moe_reference
from harness.kernels.fused_moe_small import SMALL_PATH_MAX_PAIRS, SmallMoEConfig, use_small_path

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_available(DEVICE),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU-only: real shapes, CUDA graphs")

E, H, I = 8, 40, 24
ROUTINGS = ["random", "repeated", "all_same", "invalid", "all_invalid"]


def make_weights(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / math.sqrt(inter)
    return w1.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def make_routing(kind, num_tokens, k, seed=0, num_experts=E):
    """ids int64 [T, k] and float32 weights [T, k] (not renormalised: any weights must work)."""
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=g) + 0.1
    if kind == "repeated":       # SERE-like: a token names one expert in consecutive slots
        ids[:, 1:] = ids[:, :1] if k > 1 else ids[:, 1:]
        if k > 2:
            ids[:, -1] = (ids[:, 0] + 1) % num_experts
    elif kind == "all_same":     # every token on expert 3 in every slot: maximal sharing
        ids[:] = 3
    elif kind == "invalid":      # expert-parallel sentinels -1 and E contribute nothing
        ids[::2, -1] = -1
        ids[:, 0] = torch.where(torch.arange(num_tokens) % 3 == 1, num_experts, ids[:, 0])
    elif kind == "all_invalid":  # token 0 has no valid slot: its row must be exactly 0
        ids[0] = -1
        if num_tokens > 1:
            ids[1, 0] = num_experts
    return ids.to(DEVICE), weights.to(DEVICE)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(fm, "_SCRATCH_FILL", float("nan"))


def nan_out(num_tokens, dtype, hidden=H):
    return torch.full((num_tokens, hidden), float("nan"), dtype=dtype, device=DEVICE)


def hidden_states(num_tokens, dtype, seed=2, hidden=H):
    return torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.fixture
def path_spy(monkeypatch):
    """Counts the small path's launches made through ``fused_moe_triton``."""
    calls = []
    real = fm.launch_small_moe

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(fm, "launch_small_moe", spy)
    return calls


# ------------------------------------------------------------------------------------------- numerics


@needs_triton
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("num_tokens,k", [(1, 1), (1, 4), (2, 3), (3, 2), (4, 4)])
def test_fp32_matches_reference_and_sorted(num_tokens, k, routing, poison):
    w1, w2 = make_weights(E, H, I, torch.float32)
    x = hidden_states(num_tokens, torch.float32)
    ids, weights = make_routing(routing, num_tokens, k, seed=num_tokens * 10 + k)
    out = fused_moe_triton(x, w1, w2, ids, weights, out=nan_out(num_tokens, torch.float32), path="small")
    want = fused_moe_reference(x, w1, w2, ids, weights)
    sorted_out = fused_moe_triton(x, w1, w2, ids, weights, path="sorted")
    assert out.dtype == torch.float32 and out.shape == (num_tokens, H)
    assert rel_err(out, want) < 1e-5
    assert rel_err(out, sorted_out) < 1e-5
    if routing == "all_invalid":
        assert torch.equal(out[0], torch.zeros_like(out[0]))


@needs_triton
@pytest.mark.parametrize("num_tokens,k", [(1, 4), (4, 2)])
def test_repeated_ids_add_up_like_one_slot_with_summed_weight(num_tokens, k, poison):
    """ids [e, e, ...] with weights (a, b, ...) equal one slot e with weight a + b + ... ."""
    w1, w2 = make_weights(E, H, I, torch.float32)
    x = hidden_states(num_tokens, torch.float32)
    ids = torch.full((num_tokens, k), 5, dtype=torch.int64, device=DEVICE)
    weights = torch.rand(num_tokens, k).to(DEVICE)
    out = fused_moe_triton(x, w1, w2, ids, weights, path="small")
    single = fused_moe_triton(x, w1, w2, ids[:, :1], weights.sum(-1, keepdim=True), path="small")
    assert rel_err(out, single) < 1e-5


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("routing", ["random", "repeated", "invalid"])
@pytest.mark.parametrize("num_tokens,k", [(1, 4), (4, 2)])
def test_half_bounded_by_torch_and_close_to_sorted(num_tokens, k, routing, dtype, poison):
    w1, w2 = make_weights(E, H, I, dtype)
    x = hidden_states(num_tokens, dtype)
    ids, weights = make_routing(routing, num_tokens, k, seed=num_tokens + k)
    weights = weights.to(dtype)
    out = fused_moe_triton(x, w1, w2, ids, weights, out=nan_out(num_tokens, dtype), path="small")
    want = fused_moe_reference(x, w1, w2, ids, weights, out_dtype=torch.float32)
    sorted_out = fused_moe_triton(x, w1, w2, ids, weights, path="sorted")
    torch_err = rel_err(torch_bf16_moe(x, w1, w2, ids, weights), want)
    # Interpreter: fp32 -> bf16 stores truncate (see fused_moe's module doc), hence 3x torch's error there.
    factor = 2.0 if DEVICE == "cuda" else 3.0
    assert out.dtype == dtype
    assert rel_err(out, want) <= factor * torch_err + 1e-3
    assert rel_err(out, want) < 2e-2
    # Both paths store act in the weights' dtype and accumulate in fp32; only summation order differs.
    assert rel_err(out, sorted_out) <= 2 * torch_err + 1e-3


@needs_triton
def test_strided_inputs_int32_ids_fp32_hidden_bf16_weights(poison):
    """Column views of ids / weights, a non-contiguous hidden, int32 ids, bf16 router weights; fp32 hidden
    with bf16 experts is cast to bf16 and returned in fp32."""
    num_tokens, k = 3, 2
    w1, w2 = make_weights(E, H, I, torch.float32)
    x = torch.randn(num_tokens, 2 * H).to(DEVICE)[:, ::2]
    ids_wide, w_wide = make_routing("random", num_tokens, 2 * k, seed=7)
    ids, weights = ids_wide.to(torch.int32)[:, ::2], w_wide.to(torch.bfloat16)[:, 1::2]
    assert not ids.is_contiguous() and not weights.is_contiguous()
    out = fused_moe_triton(x, w1, w2, ids, weights, path="small")
    assert rel_err(out, fused_moe_reference(x, w1, w2, ids, weights)) < 1e-5

    w1b, w2b = w1.bfloat16(), w2.bfloat16()
    out = fused_moe_triton(x, w1b, w2b, ids, weights, out=nan_out(num_tokens, torch.float32), path="small")
    want = fused_moe_reference(x.bfloat16(), w1b, w2b, ids, weights, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and rel_err(out, want) < 2e-2


@needs_triton
@pytest.mark.parametrize("cfg", [
    SmallMoEConfig(8, 32, 32, 8, up_warps=2, down_warps=1, num_stages=2, unroll=2, down_all_slots=False),
    SmallMoEConfig(32, 64, 64, 32, up_warps=1, down_warps=2, num_stages=1, unroll=1, down_all_slots=True),
    SmallMoEConfig(16, 16, 16, 16, up_warps=1, down_warps=1, num_stages=1, unroll=1, down_all_slots=False),
], ids=["slot-loop", "all-slots-wide", "slot-loop-default-tiles"])
@pytest.mark.parametrize("num_tokens,k", [(2, 4), (3, 3)])
def test_other_tile_configs(num_tokens, k, cfg, poison):
    w1, w2 = make_weights(E, H, I, torch.float32)
    x = hidden_states(num_tokens, torch.float32)
    ids, weights = make_routing("invalid", num_tokens, k)
    out = fused_moe_triton(x, w1, w2, ids, weights, out=nan_out(num_tokens, torch.float32), path="small",
                           small_config=cfg)
    assert rel_err(out, fused_moe_reference(x, w1, w2, ids, weights)) < 1e-5


@needs_triton
def test_zero_weights_give_exact_zeros():
    w1, w2 = make_weights(E, H, I, torch.float32)
    x = hidden_states(2, torch.float32)
    ids, weights = make_routing("random", 2, 3)
    out = fused_moe_triton(x, w1, w2, ids, torch.zeros_like(weights), path="small")
    assert torch.equal(out, torch.zeros_like(out))


# ------------------------------------------------------------------------------------------- dispatch


def test_use_small_path_rule():
    assert use_small_path(1) and use_small_path(SMALL_PATH_MAX_PAIRS)
    assert not use_small_path(SMALL_PATH_MAX_PAIRS + 1)
    assert use_small_path(10_000, "small") and not use_small_path(1, "sorted")
    with pytest.raises(ValueError, match="path"):
        use_small_path(1, "fast")


@needs_triton
def test_dispatch_small_at_threshold_sorted_above(path_spy, poison):
    """auto: S = SMALL_PATH_MAX_PAIRS pairs take the small path, one more pair the sorted one; forcing
    either path overrides that; both give the reference's answer."""
    w1, w2 = make_weights(E, H, I, torch.float32)
    k = 4
    t_small = SMALL_PATH_MAX_PAIRS // k
    for num_tokens, kk, want_small in ((1, k, True), (t_small, k, True), (SMALL_PATH_MAX_PAIRS + 1, 1, False)):
        x = hidden_states(num_tokens, torch.float32)
        ids, weights = make_routing("random", num_tokens, kk)
        before = len(path_spy)
        out = fused_moe_triton(x, w1, w2, ids, weights, out=nan_out(num_tokens, torch.float32))
        assert (len(path_spy) > before) == want_small, (num_tokens, kk)
        assert rel_err(out, fused_moe_reference(x, w1, w2, ids, weights)) < 1e-5
    x = hidden_states(1, torch.float32)
    ids, weights = make_routing("random", 1, k)
    before = len(path_spy)
    fused_moe_triton(x, w1, w2, ids, weights, path="sorted")
    assert len(path_spy) == before
    x = hidden_states(SMALL_PATH_MAX_PAIRS + 1, torch.float32)
    ids, weights = make_routing("random", SMALL_PATH_MAX_PAIRS + 1, 1)
    out = fused_moe_triton(x, w1, w2, ids, weights, path="small")
    assert len(path_spy) == before + 1
    assert rel_err(out, fused_moe_reference(x, w1, w2, ids, weights)) < 1e-5
    with pytest.raises(ValueError, match="path"):
        fused_moe_triton(x, w1, w2, ids, weights, path="fast")


@needs_triton
def test_auto_follows_the_config_passed(path_spy):
    """Under path="auto" a sorted-path ``config`` alone means the sorted path (a tile sweep of the sorted
    kernels at B = 1 must not time the small one), a ``small_config`` alone the small path at any S."""
    w1, w2 = make_weights(E, H, I, torch.float32)
    x = hidden_states(1, torch.float32)
    ids, weights = make_routing("random", 1, 4)
    fused_moe_triton(x, w1, w2, ids, weights, config=fm.INTERPRETER_CONFIG)
    assert path_spy == []
    x = hidden_states(SMALL_PATH_MAX_PAIRS + 1, torch.float32)
    ids, weights = make_routing("random", SMALL_PATH_MAX_PAIRS + 1, 1)
    out = fused_moe_triton(x, w1, w2, ids, weights, small_config=fms.SMALL_INTERPRETER_CONFIG)
    assert path_spy == [SMALL_PATH_MAX_PAIRS + 1]
    assert rel_err(out, fused_moe_reference(x, w1, w2, ids, weights)) < 1e-5


@needs_triton
def test_custom_op_and_dispatcher_use_small_path(path_spy):
    """``fused_moe`` (eager), ``torch.ops.harness.fused_moe`` and a fullgraph compile all take the small path
    at decode sizes and match the reference."""
    w1, w2 = make_weights(E, H, I, torch.float32)
    x = hidden_states(2, torch.float32)
    ids, weights = make_routing("repeated", 2, 3)
    want = fused_moe_reference(x, w1, w2, ids, weights)
    assert rel_err(fused_moe(x, w1, w2, ids, weights), want) < 1e-5
    assert rel_err(torch.ops.harness.fused_moe(x, w1, w2, ids, weights), want) < 1e-5
    torch._dynamo.reset()
    compiled = torch.compile(fused_moe, backend="aot_eager", fullgraph=True)
    assert rel_err(compiled(x, w1, w2, ids, weights), want) < 1e-5
    assert len(path_spy) >= 3


def test_small_module_imports_torch_and_triton_only():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(fms))
    roots = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
             for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert roots <= {"__future__", "dataclasses", "torch", "triton"}, roots


# ------------------------------------------------------------------------------------------- GPU only


@needs_cuda
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_gpu_real_shapes_graph_replay_follows_new_routing(num_tokens):
    """Qwen3-30B-A3B shapes, bf16: the small path matches the reference, is deterministic, and a CUDA graph
    of it follows new routing (including invalid ids) on replay."""
    e, h, i, k = 128, 2048, 768, 8
    g = torch.Generator().manual_seed(0)
    w1 = (torch.randn(e, 2 * i, h, generator=g) / math.sqrt(h)).to("cuda", torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) / math.sqrt(i)).to("cuda", torch.bfloat16)
    x = torch.randn(num_tokens, h, device="cuda", dtype=torch.bfloat16)
    ids, weights = make_routing("random", num_tokens, k, num_experts=e)
    weights = weights.bfloat16()
    out = torch.empty_like(x)
    fused_moe_triton(x, w1, w2, ids, weights, out=out, path="small")
    want = fused_moe_reference(x, w1, w2, ids, weights, out_dtype=torch.float32)
    assert rel_err(out, want) < 1e-2
    assert torch.equal(out, fused_moe_triton(x, w1, w2, ids, weights, path="small")), "a race"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe_triton(x, w1, w2, ids, weights, out=out)
    for kind in ("repeated", "invalid"):
        ids2, weights2 = make_routing(kind, num_tokens, k, seed=9, num_experts=e)
        ids.copy_(ids2)
        weights.copy_(weights2)
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        want = fused_moe_reference(x, w1, w2, ids, weights, out_dtype=torch.float32)
        assert rel_err(out, want) < 1e-2
