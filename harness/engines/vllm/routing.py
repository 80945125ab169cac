"""What SERE's and ``moe.top_k``'s routing functions share: the stock top-k, the layer index of a MoE
prefix, the step's decode rows, per-layer counters and the test trace.

**The stock top-k** (:func:`stock_topk`) is computed exactly as transformers' router does, in this order:
``softmax`` in float32 over all experts, ``topk`` (sorted: slot order matters, SERE's primary slots are the
first ``k``), renormalise when ``renormalize`` (``norm_topk_prob``), cast the weights to the logits' dtype
(as HF does; vLLM then upcasts to float32). vLLM's own CPU router takes top-k on logits and softmaxes the k
values — equal in exact arithmetic, not bit for bit, hence the explicit order.

**Decode rows without host synchronisation** (:class:`DecodeRows`, published once per step by the runner
wrapper that :func:`harness.engines.vllm.plugin.register` installs). A row (token) of a step is a decode row
iff the token it feeds is a *generated* token: ``num_computed_tokens[req] + (row − query_start[req]) >=
num_prompt_tokens[req]`` (the scheduler's own counters, host arrays). In a normal step that is every
row of a request that is past its prompt (one row per decoding request), and no row of a request still
in (chunked) prefill — also a prefill chunk of a single token, which a ``query_len == 1`` rule would get
wrong (prefix-cache hits, the last token of a chunked prompt). After a preemption, a request recomputes
prompt + generated tokens; the generated ones are re-routed again, as they were when first decoded. The
mask is built on the host from host arrays (where vLLM builds its own inputs) and copied (non-blocking)
into a persistent per-device buffer; the routing function slices ``buffer[:num_tokens]``, so nothing
in the forward pass reads a value back to the host. The buffer is persistent so that a CUDA graph
captured around the MoE layer reads the current step's mask on replay (``harness.techniques.sere_graphs``:
allocated at ``max_num_tokens`` before the first read, never re-allocated once graphs are captured); dummy /
profile / capture runs see an all-False mask (the ``_dummy_run`` wrapper clears it). Rows beyond the step's
real tokens (padding) are never decode rows.

**Trace** (``HARNESS_SERE_TRACE``, tests only: it synchronises): one JSON line per routing call with the
pid, layer, number of rows, the indices of the rows treated as decode rows, whether any non-decode row's
ids changed (must be false) and how many slots moved.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(prefix: str) -> int | None:
    """Decoder-layer index from a module prefix (``...layers.7.mlp.experts`` → 7); None if absent."""
    hits = _LAYER_RE.findall(prefix or "")
    return int(hits[-1]) if hits else None


def stock_topk(gating_output, topk: int, renormalize: bool):
    """Qwen3 / Qwen3-VL-MoE top-k exactly as transformers computes it: float32 softmax over all experts,
    sorted top-k, renormalise, weights cast to the logits' dtype. Returns (weights, ids int64)."""
    import torch

    probs = torch.softmax(gating_output, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(gating_output.dtype), ids


class DecodeRows:
    """The step's decode-row mask in a persistent per-device buffer (see module doc), on top of
    ``harness.techniques.sere_graphs.StepRows`` (the graph-safe contract: one allocation, written in place
    before every step, frozen before graphs are captured, all False in dummy / profile runs)."""

    def __init__(self) -> None:
        from harness.techniques.sere_graphs import StepRows

        self.steps = StepRows(capacity=256)
        self.dummy = 0  # > 0 while inside a dummy / profile run

    @property
    def n_decode(self) -> int:
        """Decode rows of the current step (a host int: the eager skip and ``moe.top_k``'s statistics)."""
        return self.steps.active

    def reserve(self, device, size: int) -> None:
        """Allocate the device's buffer at ``size`` rows (the runner's ``max_num_tokens``) before anything
        reads it, so the buffer a capture records is the one every later step writes."""
        self.steps.capacity = max(self.steps.capacity, int(size))
        self.steps.buffer(device, int(size))

    def publish(self, runner, num_tokens: int, num_reqs: int, num_tokens_padded: int | None) -> None:
        import torch

        total = max(int(num_tokens_padded or 0), int(num_tokens), int(getattr(runner, "max_num_tokens", 0)))
        device = runner.device
        self.reserve(device, total)
        padded = int(num_tokens_padded or num_tokens)
        host = torch.zeros(padded, dtype=torch.bool)
        if not self.dummy and num_reqs > 0 and num_tokens > 0:
            qsl = runner.query_start_loc.cpu[: num_reqs + 1].to(torch.int64)
            computed = runner.input_batch.num_computed_tokens_cpu_tensor[:num_reqs].to(torch.int64)
            prompt = runner.input_batch.num_prompt_tokens_cpu_tensor[:num_reqs].to(torch.int64)
            q_lens = qsl[1:] - qsl[:-1]
            req = torch.repeat_interleave(torch.arange(num_reqs), q_lens)
            n = min(int(req.numel()), int(num_tokens), padded)
            req = req[:n]
            offset = torch.arange(n) - qsl[req]
            host[:n] = (computed[req] + offset) >= prompt[req]
        self.steps.write(device, host, total)

    def clear(self) -> None:
        """A step that publishes nothing (dummy / profile / capture run): no decode row anywhere."""
        self.steps.clear()

    def rows(self, device, num_rows: int):
        """``buffer[:num_rows]`` — always the persistent buffer (allocated here if nothing was published yet:
        a routing function must never see "no mask" and take a different path at capture)."""
        return self.steps.rows(device, num_rows)


DECODE = DecodeRows()  # the process's one instance (the runner wrapper writes it, routing functions read it)


class Trace:
    def __init__(self, path: str) -> None:
        self.path = path
        self.lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self.lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line)


class LayerStats:
    """Decode-step routing statistics of one layer, as ``harness.engines.hf_sere`` keeps them: device
    counters [distinct experts before, after, |P|, moved slots] summed over decode steps (no host sync in
    the forward pass; step/token/slot counts are host ints), read by ``sere.sere_stats`` / ``topk.moe_stats``."""

    def __init__(self, layer: int, num_experts: int, protected) -> None:
        self.layer, self.num_experts = layer, num_experts
        self.protected = int(protected.sum()) if protected is not None else 0
        self.reset()

    def reset(self) -> None:
        self.steps = self.tokens = self.secondary_slots = 0
        self.acc = None

    def add(self, old, new, mask, k_primary: int, n_decode: int) -> None:
        import torch

        e = self.num_experts

        def distinct(ids):
            flat = torch.where(mask[:, None], ids, torch.full_like(ids, e)).reshape(-1).long()
            flat = torch.where((flat >= 0) & (flat < e), flat, torch.full_like(flat, e))
            seen = torch.zeros(e + 1, dtype=torch.bool, device=ids.device).index_fill_(0, flat, True)
            return seen[:e].sum()

        k = old.shape[1]
        kp = min(k_primary, k)
        vals = torch.stack([distinct(old), distinct(new), distinct(old[:, :kp]),
                            ((old != new) & mask[:, None]).sum()])
        self.acc = vals if self.acc is None else self.acc + vals
        self.steps += 1
        self.tokens += n_decode
        self.secondary_slots += n_decode * (k - kp)


def layer_stats_summary(stats: dict[int, LayerStats], reset: bool = False) -> dict[str, Any]:
    """Per-layer and overall means of ``LayerStats`` counters (SERE's and ``moe.top_k``'s)."""
    per_layer, sums, tot_steps, tot_slots = [], [0, 0, 0, 0], 0, 0
    for layer in sorted(stats):
        st = stats[layer]
        before, after, prim, moved = st.acc.tolist() if st.acc is not None else (0, 0, 0, 0)
        steps = st.steps
        per_layer.append({
            "layer": layer, "steps": steps, "tokens": st.tokens,
            "expert_union_before": before / steps if steps else None,
            "expert_union_after": after / steps if steps else None,
            "primary_union": prim / steps if steps else None,
            "moved_slots": moved, "secondary_slots": st.secondary_slots,
            "moved_fraction": moved / st.secondary_slots if st.secondary_slots else None,
            "protected": st.protected,
        })
        sums = [a + b for a, b in zip(sums, (before, after, prim, moved))]
        tot_steps += steps
        tot_slots += st.secondary_slots
        if reset:
            st.reset()
    n_steps = max((st["steps"] for st in per_layer), default=0)
    n_tokens = max((st["tokens"] for st in per_layer), default=0)
    mean = (lambda v: v / tot_steps) if tot_steps else (lambda v: None)
    before, after = mean(sums[0]), mean(sums[1])
    return {
        "layers": len(per_layer), "steps": n_steps,
        "tokens_per_step": n_tokens / n_steps if n_steps else None,
        "expert_union_before": before, "expert_union_after": after,
        "experts_saved": before - after if tot_steps else None,
        "primary_union": mean(sums[2]),
        "moved_fraction": sums[3] / tot_slots if tot_slots else None,
        "per_layer": per_layer,
    }
