"""SERE's multi-program plan (harness.kernels.fused_routing_epoch: epoch-tagged expert sets, no arrivals): the
reference's ids, weights and counters on every SERE spec and tiling (Triton's interpreter on CPU, CUDA where there
is one), step after step on one scratch — an epoch that did not advance, or a sum left over, would put one step's
experts or rows into the next step's P or counters — and a failed launch leaves no step behind."""

from __future__ import annotations

import pytest
import torch

import harness.kernels.fused_routing_epoch as epoch_module
from harness.kernels.fused_routing import fused_routing_reference, fused_routing_triton
from test_fused_routing import SPECS, check_against_reference, make_case, spec_of

SERE_SPECS = [n for n in SPECS if "k_primary" in SPECS[n]]


def _words(experts: int = 32):
    """The plan's scratch of a 32-expert block (the tests' steps of other sizes keep their own)."""
    return [w for w in epoch_module._EPOCH_SCRATCH.values() if w.numel() == 5 * experts + 8]


def check_without_counters(logits, spec, decode, real, **kwargs):
    """Ids and weights of a run that keeps no counters (the counters' launch does not run)."""
    ww, wid = fused_routing_reference(logits, spec, decode, real)
    gw, gid = fused_routing_triton(logits, spec, decode, real, multi=True, **kwargs)
    assert torch.equal(gid, wid), kwargs
    torch.testing.assert_close(gw, ww, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", SERE_SPECS)
@pytest.mark.parametrize("shape,block_t", [((1, 16), None), ((9, 32), None), ((9, 32), 2), ((40, 64), 8),
                                           ((70, 128), 16)], ids=lambda v: str(v))
def test_epoch_plan_matches_reference(shape, block_t, name):
    """Small tiles (every slot in one gather) and tall ones (the per-expert table), with and without the
    counters, equal the reference."""
    t, e = shape
    logits, sim, protected, decode, real = make_case(t, e, seed=t * 5 + e)
    decode[0] = True
    spec = spec_of(name, sim, protected, top_k=min(8, e // 2))
    check_against_reference(logits, spec, decode, real, multi=True, block_t=block_t)
    check_without_counters(logits, spec, decode, real, block_t=block_t)


def test_epoch_plan_step_after_step_on_one_scratch():
    """Steps of every SERE spec, length and decode pattern in a row, with and without counters, each equal the
    reference: each step's sets are told apart by its epoch alone (nothing is zeroed between steps), every step
    is closed (C1 = C2) and the counters' sums start from zero every time."""
    cases = [(9, 32, "top4-sere-k2", 2, True), (37, 32, "sere-k2", 4, False), (16, 32, "sere-k1-rho", 1, True),
             (70, 32, "sere-k2", 16, True), (5, 32, "top4-sere-k2", 1, False), (3, 32, "sere-k2", 1, True)]
    epochs = []
    for i, (t, e, name, block_t, stats) in enumerate(cases * 2):
        logits, sim, protected, decode, real = make_case(t, e, seed=300 + i)
        decode[i % t] = True
        spec = spec_of(name, sim, protected)
        if stats:
            check_against_reference(logits, spec, decode, real, multi=True, block_t=block_t)
        else:
            check_without_counters(logits, spec, decode, real, block_t=block_t)
        (words,) = _words()
        head = words[5 * 32:].tolist()
        assert head[0] == head[1], f"call {i} ({name}, T={t}) was not closed"
        assert head[2:5] == [0, 0, 0], f"call {i} ({name}, T={t}) left its counters' sums"
        epochs.append(head[0])
    assert epochs == sorted(epochs) and len(set(epochs)) == len(epochs)


def test_epoch_plan_forgets_a_failed_step(monkeypatch):
    """A re-route launch that never ran leaves launch 1's marks under an epoch the next step would reuse: the
    scratch is zeroed, and the next step gives the reference's routing."""
    logits, sim, protected, decode, real = make_case(9, 32, seed=5)
    decode[:] = True
    spec = spec_of("sere-k2", sim, protected)

    class Broken:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("launch failed")
            return launch
    monkeypatch.setattr(epoch_module, "_epoch_reroute_kernel", Broken())
    with pytest.raises(RuntimeError, match="launch failed"):
        fused_routing_triton(logits, spec, decode, real, multi=True, block_t=2)
    assert _words() and all(int(w.abs().sum()) == 0 for w in _words())
    monkeypatch.undo()
    other = make_case(9, 32, seed=6)
    other[3][:] = True
    check_against_reference(other[0], spec, other[3], other[4], multi=True, block_t=2)
