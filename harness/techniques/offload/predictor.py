"""The seed's stability predictor: a ~50K-parameter 2-layer MLP over the current and previous 3 token embeddings.

**Target (the "stability score"), defined per (token, layer).** For decode token ``t`` of a request and MoE
layer ``l`` with selected experts ``S(t, l)`` (``k`` of them):

    stability(t, l) = 1 / (k · W) · Σ_{e ∈ S(t, l)} Σ_{d = 1..W} [e ∈ S(t + d, l)],   W = min(horizon, tokens left)

i.e. how often, over the next ``horizon`` (= 5) tokens of the same request, the token's experts are selected
again, averaged over its ``k`` experts ("how often the token's expert is re-selected within the next 5
tokens"). Tokens with no successor (W = 0) have no target and are not trained on. Why per (token, layer) and
not per (token, layer, expert): (1) the predictor reads embeddings only, which say nothing about *which*
expert a router picks, so a per-expert output would have to re-learn every router; (2) the output stays
``L`` wide whatever the expert count, which keeps the MLP at ~50K parameters for Qwen3-30B-A3B's 48×128
experts; (3) the lease policy makes one decision per (token, layer) — the lease length of that layer's experts.
The per-expert version is :func:`stability_per_expert` (its mean over the k experts is the target).

**Model.** Input: the embeddings of tokens ``t, t−1, t−2, t−3`` of the same request (zeros before its first
token), each standardised (train mean/std) and reduced by a fixed seeded random projection to ``proj_dim``
(Johnson–Lindenstrauss; stored in the artifact, not trained — it keeps the parameter count independent of the
model's hidden size), concatenated → Linear → GELU → Linear → sigmoid, one output per MoE layer. The hidden
width is chosen so the trainable parameters come to ~``target_params`` (50K).

**Baselines reported beside it** (held-out requests): ``mean`` — the training mean per layer; ``recency`` —
the causal mirror of the target, how often the token's experts were selected over the *previous* ``horizon``
tokens (what an LRU-like rule already knows at time t, for free). The predictor only earns its keep where it
beats ``recency``.

CLI: ``python -m harness.techniques.offload.predictor train TRACE [TRACE ...] --out ARTIFACT`` writes ``ARTIFACT.pt``
(weights + buffers) and ``ARTIFACT.json`` (spec, held-out metrics, traces used).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from harness.techniques.offload.trace import RoutingTrace, load_trace

__all__ = ["HORIZON", "CONTEXT", "stability_targets", "stability_per_expert", "recency_scores", "context_windows",
           "StabilityPredictor", "PredictorSpec", "train_predictor", "save_predictor", "load_predictor",
           "OnlineScorer", "auc", "main"]

HORIZON = 5  # tokens ahead the target looks (the seed's "next 5 tokens")
CONTEXT = 4  # current + previous 3 embeddings (the seed's input)


# -- targets ----------------------------------------------------------------------------------------
def _onehot(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, L, k] ids → bool [T, L, E] (ids outside [0, E) dropped)."""
    t, nl, _ = ids.shape
    valid = (ids >= 0) & (ids < num_experts)
    out = torch.zeros(t, nl, num_experts + 1, dtype=torch.bool)
    out.scatter_(2, torch.where(valid, ids, num_experts), True)
    return out[..., :num_experts]


def _windowed(trace: RoutingTrace, horizon: int, forward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, layer, slot): how many of the next (forward) / previous horizon tokens of the request select
    the slot's expert, and W (tokens in the window) per token."""
    counts = torch.zeros(trace.ids.shape, dtype=torch.float32)
    width = torch.zeros(trace.num_tokens, dtype=torch.float32)
    e = trace.num_experts
    for sl in trace.request_slices():
        ids = trace.ids[sl]
        n = ids.shape[0]
        hot = _onehot(ids, e).float()  # [T, L, E]
        csum = torch.cat([torch.zeros(1, *hot.shape[1:]), hot.cumsum(0)])  # csum[i] = Σ_{j<i} hot[j]
        idx = torch.arange(n)
        if forward:
            lo, hi = idx + 1, (idx + 1 + horizon).clamp_max(n)
        else:
            lo, hi = (idx - horizon).clamp_min(0), idx
        win = csum[hi] - csum[lo]  # [T, L, E]: selections of each expert in the window
        valid = (ids >= 0) & (ids < e)
        counts[sl] = torch.where(valid, win.gather(2, ids.clamp(0, e - 1)), torch.zeros(()))
        width[sl] = (hi - lo).float()
    return counts, width


def stability_per_expert(trace: RoutingTrace, horizon: int = HORIZON) -> tuple[torch.Tensor, torch.Tensor]:
    """(score [N, L, k] = share of the next W tokens selecting the slot's expert again, valid [N] = W > 0)."""
    counts, width = _windowed(trace, horizon, forward=True)
    return counts / width.clamp_min(1).view(-1, 1, 1), width > 0


def _mean_over_slots(per_slot: torch.Tensor, ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    valid = ((ids >= 0) & (ids < num_experts)).float()
    return (per_slot * valid).sum(-1) / valid.sum(-1).clamp_min(1)


def stability_targets(trace: RoutingTrace, horizon: int = HORIZON) -> tuple[torch.Tensor, torch.Tensor]:
    """(stability [N, L] as defined in the module doc, valid [N]: the token has at least one successor)."""
    per, valid = stability_per_expert(trace, horizon)
    return _mean_over_slots(per, trace.ids, trace.num_experts), valid


def recency_scores(trace: RoutingTrace, horizon: int = HORIZON) -> torch.Tensor:
    """The causal baseline [N, L]: share of the previous W tokens that selected the token's experts (0 at a
    request's first token)."""
    counts, width = _windowed(trace, horizon, forward=False)
    return _mean_over_slots(counts / width.clamp_min(1).view(-1, 1, 1), trace.ids, trace.num_experts)


def context_windows(trace: RoutingTrace, context: int = CONTEXT) -> torch.Tensor:
    """[N, context, H]: embeddings of tokens t, t−1, …, t−context+1 of the same request (zeros before its start)."""
    n, h = trace.embeds.shape
    out = torch.zeros(n, context, h)
    for sl in trace.request_slices():
        emb = trace.embeds[sl].float()
        for c in range(context):
            if c < emb.shape[0]:
                out[sl.start + c: sl.stop, c] = emb[: emb.shape[0] - c]
    return out


# -- model ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PredictorSpec:
    hidden_size: int  # embedding width H
    num_layers: int  # MoE layers (outputs)
    proj_dim: int = 48
    hidden: int = 0  # 0 = chosen so the trainable parameters come to ~target_params
    target_params: int = 50_000
    context: int = CONTEXT
    horizon: int = HORIZON
    seed: int = 0

    def resolved_hidden(self) -> int:
        if self.hidden:
            return self.hidden
        fan_in = self.context * min(self.proj_dim, self.hidden_size)
        return max(8, round((self.target_params - self.num_layers) / (fan_in + 1 + self.num_layers)))


class StabilityPredictor(torch.nn.Module):
    """window [B, context, H] → stability score per MoE layer [B, L] in [0, 1]."""

    def __init__(self, spec: PredictorSpec):
        super().__init__()
        self.spec = spec
        d = min(spec.proj_dim, spec.hidden_size)
        g = torch.Generator().manual_seed(spec.seed)
        proj = torch.randn(spec.hidden_size, d, generator=g) / math.sqrt(d) if d < spec.hidden_size else \
            torch.eye(spec.hidden_size)
        self.register_buffer("proj", proj)
        self.register_buffer("mean", torch.zeros(spec.hidden_size))
        self.register_buffer("std", torch.ones(spec.hidden_size))
        hidden = spec.resolved_hidden()
        self.fc1 = torch.nn.Linear(spec.context * d, hidden)
        self.fc2 = torch.nn.Linear(hidden, spec.num_layers)

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        present = (window.abs().sum(-1, keepdim=True) > 0).to(window.dtype)  # a missing token stays zero
        x = (window - self.mean) / self.std * present
        x = (x @ self.proj).flatten(1)
        return torch.sigmoid(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


# -- metrics ----------------------------------------------------------------------------------------
def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC (Mann–Whitney, ties averaged); NaN when one class is absent."""
    s, y = scores.flatten().double(), labels.flatten().bool()
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    uniq, inv, counts = torch.unique(s, return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    avg_rank = ends - (counts.double() - 1) / 2  # 1-based average rank of each distinct value
    ranks = avg_rank[inv]
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _metrics(pred: torch.Tensor, target: torch.Tensor, label_threshold: float) -> dict[str, float]:
    label = target >= label_threshold
    p, t = pred.flatten().double(), target.flatten().double()
    corr = float(torch.corrcoef(torch.stack([p, t]))[0, 1]) if p.numel() > 1 and p.std() > 0 else math.nan
    return {"mse": float(((p - t) ** 2).mean()), "mae": float((p - t).abs().mean()), "pearson": corr,
            "auc": auc(pred, label), "accuracy": float(((pred >= label_threshold) == label).float().mean())}


# -- training ---------------------------------------------------------------------------------------
def _concat(traces: list[RoutingTrace]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(windows, targets, valid, recency, request ids unique across traces)."""
    shapes = {(t.num_layers, t.embeds.shape[1]) for t in traces}
    if len(shapes) != 1:
        raise ValueError(f"traces disagree on (MoE layers, embedding width): {sorted(shapes)}")
    if traces[0].embeds.shape[1] == 0:
        raise ValueError("the trace has no token embeddings (recorded with record_embeds=False)")
    wins, tgts, vals, recs, reqs, offset = [], [], [], [], [], 0
    for tr in traces:
        tgt, valid = stability_targets(tr)
        wins.append(context_windows(tr))
        tgts.append(tgt)
        vals.append(valid)
        recs.append(recency_scores(tr))
        reqs.append(tr.request + offset)
        offset += tr.num_requests
    return torch.cat(wins), torch.cat(tgts), torch.cat(vals), torch.cat(recs), torch.cat(reqs)


def train_predictor(traces: list[RoutingTrace], *, holdout: float = 0.2, seed: int = 0, epochs: int = 60,
                    lr: float = 3e-3, weight_decay: float = 1e-4, batch: int = 256, label_threshold: float = 0.5,
                    spec_overrides: dict[str, Any] | None = None, progress: bool = False
                    ) -> tuple[StabilityPredictor, dict[str, Any]]:
    """Train on the traces' requests minus a held-out share (split by request, seeded); return the model and
    its report (held-out metrics of the model and of both baselines). The epoch kept is the one with the best
    loss on a validation tenth of the training requests (early stopping, no peeking at the held-out set)."""
    win, tgt, valid, rec, req = _concat(traces)
    n_req = int(req.max()) + 1
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(n_req, generator=g)
    n_hold = max(1, round(holdout * n_req)) if n_req > 1 else 0
    hold_req = order[:n_hold]
    rest = order[n_hold:]
    n_val = max(1, round(0.1 * len(rest))) if len(rest) > 2 else 0
    val_req, train_req = rest[:n_val], rest[n_val:]
    if len(train_req) == 0:
        raise ValueError(f"{n_req} request(s): too few to split into train / held-out (need >= 2)")

    def rows(reqs: torch.Tensor) -> torch.Tensor:
        return (torch.isin(req, reqs) & valid).nonzero().flatten()

    tr_rows, va_rows, ho_rows = rows(train_req), rows(val_req), rows(hold_req)
    spec = PredictorSpec(hidden_size=win.shape[-1], num_layers=tgt.shape[1], seed=seed, **(spec_overrides or {}))
    torch.manual_seed(seed)
    model = StabilityPredictor(spec)
    present = win[tr_rows][win[tr_rows].abs().sum(-1) > 0]  # [M, H]: real embeddings only
    model.mean.copy_(present.mean(0))
    model.std.copy_(present.std(0).clamp_min(1e-4))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    best, best_state, best_epoch = math.inf, None, -1
    it = range(epochs)
    if progress:
        from tqdm import tqdm

        it = tqdm(it, desc="predictor", unit="epoch", file=sys.stderr)
    for epoch in it:
        model.train()
        perm = tr_rows[torch.randperm(len(tr_rows), generator=g)]
        for i in range(0, len(perm), batch):
            b = perm[i: i + batch]
            loss = torch.nn.functional.mse_loss(model(win[b]), tgt[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            check = va_rows if len(va_rows) else tr_rows
            vloss = float(torch.nn.functional.mse_loss(model(win[check]), tgt[check]))
        if vloss < best:
            best, best_epoch = vloss, epoch
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    model.eval()
    with torch.no_grad():
        pred = model(win[ho_rows]) if len(ho_rows) else torch.zeros(0, tgt.shape[1])
    train_mean = tgt[tr_rows].mean(0, keepdim=True)
    y = tgt[ho_rows]
    report = {
        "target": f"stability(t, l): share of the next {spec.horizon} tokens re-selecting token t's experts at "
                  f"layer l, averaged over its k experts (per token and layer)",
        "label_threshold": label_threshold,
        "split": {"requests": n_req, "train": len(train_req), "validation": len(val_req), "held_out": n_hold,
                  "train_tokens": len(tr_rows), "held_out_tokens": len(ho_rows), "seed": seed},
        "training": {"epochs": epochs, "best_epoch": best_epoch, "val_mse": best, "lr": lr,
                     "weight_decay": weight_decay, "batch": batch},
        "params": model.num_trainable(),
        "target_mean_held_out": float(y.mean()) if len(y) else math.nan,
        "label_share_held_out": float((y >= label_threshold).float().mean()) if len(y) else math.nan,
        "held_out": {
            "predictor": _metrics(pred, y, label_threshold) if len(y) else {},
            "baseline_mean": _metrics(train_mean.expand_as(y), y, label_threshold) if len(y) else {},
            "baseline_recency": _metrics(rec[ho_rows], y, label_threshold) if len(y) else {},
        },
    }
    return model, report


# -- artifacts --------------------------------------------------------------------------------------
def _paths(path: str | Path) -> tuple[Path, Path]:
    p = Path(path)
    base = p.with_suffix("") if p.suffix in (".pt", ".json") else p
    return base.with_suffix(".pt"), base.with_suffix(".json")


def save_predictor(model: StabilityPredictor, report: dict[str, Any], path: str | Path,
                   meta: dict[str, Any] | None = None) -> Path:
    pt, js = _paths(path)
    pt.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"spec": asdict(model.spec), "state_dict": model.state_dict()}, pt)
    js.write_text(json.dumps({"format": "harness-stability-predictor/1", "spec": asdict(model.spec),
                              **report, **(meta or {})}, indent=2, sort_keys=True, default=str) + "\n")
    return pt


def load_predictor(path: str | Path) -> StabilityPredictor:
    pt, _ = _paths(path)
    blob = torch.load(pt, map_location="cpu", weights_only=True)
    model = StabilityPredictor(PredictorSpec(**blob["spec"]))
    model.load_state_dict(blob["state_dict"])
    return model.eval()


class OnlineScorer:
    """The predictor at decode time: keeps each row's last ``context − 1`` embeddings; ``score(emb [B, H])`` →
    [B, L] scores; :meth:`reset` at a new batch (a prefill)."""

    def __init__(self, model: StabilityPredictor):
        self.model = model
        self.window: torch.Tensor | None = None

    def reset(self) -> None:
        self.window = None

    @torch.no_grad()
    def score(self, emb: torch.Tensor) -> torch.Tensor:
        emb = emb.detach().float().to(self.model.proj.device)
        b = emb.shape[0]
        ctx = self.model.spec.context
        if self.window is None or self.window.shape[0] != b:
            self.window = torch.zeros(b, ctx, emb.shape[1], device=emb.device)
        self.window = torch.cat([emb.unsqueeze(1), self.window[:, : ctx - 1]], dim=1)
        return self.model(self.window)


# -- CLI --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m harness.techniques.offload.predictor",
                                 description="Train the stability predictor on routing traces.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train on TRACE files (harness.techniques.offload.trace format)")
    tr.add_argument("traces", nargs="+")
    tr.add_argument("--out", required=True, help="artifact path (writes OUT.pt and OUT.json)")
    tr.add_argument("--holdout", type=float, default=0.2)
    tr.add_argument("--epochs", type=int, default=60)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--label-threshold", type=float, default=0.5)
    args = ap.parse_args(argv)
    traces = [load_trace(p) for p in args.traces]
    model, report = train_predictor(traces, holdout=args.holdout, seed=args.seed, epochs=args.epochs,
                                    label_threshold=args.label_threshold, progress=True)
    out = save_predictor(model, report, args.out, {"traces": [{"path": str(p), **{k: t.meta.get(k) for k in (
        "model", "dataset", "seed", "source")}} for p, t in zip(args.traces, traces, strict=True)]})
    h = report["held_out"]
    print(f"wrote {out} ({report['params']} params); held-out MSE predictor {h['predictor']['mse']:.4f} vs "
          f"mean {h['baseline_mean']['mse']:.4f} vs recency {h['baseline_recency']['mse']:.4f}; "
          f"AUC predictor {h['predictor']['auc']:.3f} vs recency {h['baseline_recency']['auc']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
