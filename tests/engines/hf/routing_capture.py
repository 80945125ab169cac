"""A recorder of what every MoE block's router chose and what its experts then received, shared by the HF
routing tests (SERE, plain top-K)."""

from __future__ import annotations

from contextlib import contextmanager

from harness.techniques.sere.calibration import find_moe_blocks


@contextmanager
def capture(model):
    """{layer: [{"seq", "batch", "logits", "orig", "orig_w", "used", "used_w"}, ...]}, one entry per MoE pass:
    the stock router's logits/ids/weights and the ids/weights the experts received.

    Enter it before installing a technique, so the router hook runs before the technique's."""
    log: dict[int, list[dict]] = {}
    hooks = []
    for ref in find_moe_blocks(model):
        entries = log.setdefault(ref.layer, [])

        def pre(module, args, entries=entries):
            entries.append({"seq": args[0].shape[1], "batch": args[0].shape[0]})

        def gate(module, args, out, entries=entries):
            entries[-1].update(logits=out[0].clone(), orig_w=out[1].clone(), orig=out[2].clone())

        def experts(module, args, entries=entries):
            entries[-1].update(used=args[1].clone(), used_w=args[2].clone())

        hooks += [ref.block.register_forward_pre_hook(pre), ref.block.gate.register_forward_hook(gate),
                  ref.block.experts.register_forward_pre_hook(experts)]
    try:
        yield log
    finally:
        for h in hooks:
            h.remove()
