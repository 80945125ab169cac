"""SERE protection: per layer, the experts whose re-routing hurts most, ranked on calibration tokens.

SERE moves a token's secondary slot from expert e to the primary expert p* nearest to it. Protecting e
(``protected[e] = True``) keeps e wherever it is chosen. The seed protects 16 experts per layer but does
not say how it picks them; this module measures it.

**Damage of an expert** (per MoE layer, given the similarity matrix, K = ``k_primary`` and ρ). Calibration
tokens are grouped into decode-like batches and routed by the layer's own router; SERE is applied to the
batch with the batch-level primary set P, exactly as at run time (``harness.techniques.sere.reroute``,
no protection). For expert e, re-route *only e's slots* (every other slot keeps its original expert) and
measure, for each token t holding e in a secondary slot,

    r_t(e) = ||MoE_t(only e re-routed) - MoE_t(original)|| / ||MoE_t(original)||

MoE_t is the block's output for the token (weighted sum of its top-k experts, weights unchanged). A
token has e in at most one slot s, so ``MoE_t(only e re-routed) - MoE_t(original) = w_ts (O_p*(x_t) -
O_e(x_t))``: one expert-output difference, computed from a dense pass of all experts on the batch (the
test checks it against the block's own experts forward). Tokens whose e-slot does not move (e in P, or
sim < ρ) contribute 0.

Two scores per expert are kept:

- ``mean``  = Σ_t r_t(e) / #(tokens with e in a secondary slot) — the damage per use (the brief's literal
  definition);
- ``total`` = Σ_t r_t(e) / #(calibration tokens) — = frequency x mean, the expected relative MoE-output
  error per token that re-routing e causes, i.e. exactly what protecting e removes.

**Ranking uses ``total`` by default.** Protection exists to recover average output quality, and the
error removed by protecting e is its total, not its per-use mean: a rarely chosen expert with a large
per-use damage matters little, while a frequent one with moderate damage matters a lot. The cost side
agrees: protecting e costs (at most) one extra expert in the steps where it would have moved, which
saturates at one expert per step for frequent experts while their benefit keeps growing. ``mean`` is
available (``rank_by="mean"``) for comparison. Ties: the lower expert id ranks first; exactly ``n``
experts per layer are protected.

**Batches (how P is formed).** Decode batches mix tokens of unrelated requests, so the calibration
tokens are shuffled with a fixed seed (``seed=0``) and cut into batches of ``batch_size`` = 16 tokens (a
decode step of 16 concurrent requests, the regime where SERE's union reduction matters; the last batch
may be smaller). The same permutation is used for every layer. The builder is deterministic for a
given model, text, similarity, K, ρ, batch size and seed.

Artifacts: safetensors with ``protected.<layer>`` bool [E] and the scores (``damage_total.<layer>``,
``damage_mean.<layer>``, float64) plus JSON metadata; :func:`load_protection` can re-derive the top-n
for another ``n`` from the stored scores, so one build serves a sweep over ``sere.protect``.

CLI: ``python -m harness.commands.sere_protect --model PATH --similarity FILE --k 2 --rho 0.1 --n 16
--out FILE [--text FILE|DIR] [--text-field NAME] [--max-tokens N] [--batch-size 16] [--rank-by total] [--device auto]``.

Only torch and the standard library are imported at module level.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from harness.techniques.sere.reroute import reroute
from harness.techniques.sere.calibration import (
    DEFAULT_MAX_SEQ_LEN,
    DEFAULT_MAX_TOKENS,
    _atomic_save,
    _harness_version,
    _now,
    _read,
    _slug,
    calibration_data,
    calibration_source_sha256,
    collect_moe_inputs,
    default_sere_cache_dir,
    expert_outputs,
    find_moe_blocks,
    model_fingerprint,
    refuse_if_sere_installed,
)

__all__ = [
    "DEFAULT_BATCH_SIZE", "compute_protection", "expert_damage", "load_protection", "protection_for",
    "save_protection", "similarity_hash", "top_n_mask",
]

ALGO_VERSION = 1
DEFAULT_BATCH_SIZE = 16
RANK_BY = ("total", "mean")
_EPS = 1e-12
_CHUNK_BUDGET_BYTES = 256 << 20


def expert_damage(block: torch.nn.Module, hidden: torch.Tensor, similarity: torch.Tensor, k_primary: int,
                  rho: float, *, batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
                  chunk_tokens: int | None = None, router: torch.nn.Module | None = None,
                  rule: Any = None) -> dict[str, torch.Tensor]:
    """Damage statistics of each expert of one MoE ``block`` on ``hidden`` [N, H] (see module doc).
    ``router`` (default ``block.gate``) and ``rule`` (the family's routing rule, ``harness.models.families``):
    a router with unsorted slots (DeepSeek) is sorted by the rule's rank key, as the engines' hooks do.

    Returns float64/int64 CPU tensors of length E: ``damage_sum`` (Σ_t r_t), ``routed`` (tokens with the
    expert in a secondary slot), ``moved`` (of those, slots SERE re-routes), ``mean``, ``total``; and
    ``tokens`` (N).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    experts = block.experts
    num_experts, two_i, h = experts.gate_up_proj.shape
    router = router if router is not None else block.gate
    bias = getattr(router, "e_score_correction_bias", None) if rule is not None and rule.has_bias else None
    device = experts.gate_up_proj.device
    sim = similarity.to(device=device, dtype=torch.float32)
    n = hidden.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    per_tok = num_experts * max(h, two_i) * 4
    chunk = chunk_tokens or max(1, _CHUNK_BUDGET_BYTES // per_tok)
    chunk = max(batch_size, chunk // batch_size * batch_size)   # whole batches per dense chunk

    damage = torch.zeros(num_experts, dtype=torch.float64, device=device)
    routed = torch.zeros(num_experts, dtype=torch.long, device=device)
    moved_n = torch.zeros(num_experts, dtype=torch.long, device=device)
    with torch.inference_mode():
        for c0 in range(0, n, chunk):
            x = hidden[perm[c0:c0 + chunk]].to(device=device, dtype=experts.gate_up_proj.dtype)
            outs = expert_outputs(experts, x)                             # [E, T, H]
            acc_dtype = torch.promote_types(outs.dtype, torch.float32)    # norms in >= float32
            outs = outs.to(acc_dtype)
            tok = torch.arange(x.shape[0], device=device)
            for b0 in range(0, x.shape[0], batch_size):
                xb = x[b0:b0 + batch_size]
                logits, w, ids = router(xb)[:3]
                if rule is not None and not rule.sorted_slots:
                    w, ids = rule.sort_slots(logits, w, ids, bias)
                k = ids.shape[1]
                if k_primary >= k:
                    continue
                new = reroute(ids, sim, k_primary, rho)
                t = tok[b0:b0 + xb.shape[0], None].expand_as(ids)
                o_old = outs[ids, t]                                      # [B, k, H]
                w = w.to(acc_dtype)
                moe = (w[..., None] * o_old).sum(1)                       # [B, H]
                diff = outs[new, t] - o_old                               # 0 where nothing moved
                r = (w * diff.norm(dim=-1)) / (moe.norm(dim=-1, keepdim=True) + _EPS)
                sec = ids[:, k_primary:].reshape(-1)
                mv = (new != ids)[:, k_primary:].reshape(-1)
                damage.index_add_(0, sec, r[:, k_primary:].reshape(-1).double() * mv)
                routed.index_add_(0, sec, torch.ones_like(sec))
                moved_n.index_add_(0, sec, mv.long())
    damage, routed, moved_n = damage.cpu(), routed.cpu(), moved_n.cpu()
    return {
        "damage_sum": damage,
        "routed": routed,
        "moved": moved_n,
        "mean": damage / routed.clamp_min(1),
        "total": damage / max(n, 1),
        "tokens": torch.tensor(n),
    }


def top_n_mask(scores: torch.Tensor, n: int) -> torch.Tensor:
    """Bool mask of the ``n`` highest scores (ties: lower index first)."""
    e = scores.numel()
    if not 0 <= n <= e:
        raise ValueError(f"n must be in [0, {e}], got {n}")
    order = torch.argsort(-scores.to(torch.float64), stable=True)
    mask = torch.zeros(e, dtype=torch.bool)
    mask[order[:n]] = True
    return mask


def similarity_hash(similarity: dict[int, torch.Tensor]) -> str:
    """sha256 (16 hex) of the matrices as float32, layer by layer."""
    h = hashlib.sha256()
    for layer in sorted(similarity):
        h.update(f"{layer};".encode())
        h.update(similarity[layer].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def compute_protection(model: torch.nn.Module, tokenizer: Any, similarity: dict[int, torch.Tensor],
                       k_primary: int, rho: float, n: int, *, text_path: str | Path | None = None,
                       max_tokens: int = DEFAULT_MAX_TOKENS, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                       batch_size: int = DEFAULT_BATCH_SIZE, rank_by: str = "total", seed: int = 0,
                       model_id: str | None = None, progress: bool = False, text_field: str | None = None,
                       ) -> tuple[dict[int, torch.Tensor], dict[int, dict[str, torch.Tensor]], dict[str, Any]]:
    """(protected {layer: bool [E]}, scores {layer: expert_damage(...)}, metadata)."""
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}, got {rank_by!r}")
    blocks = find_moe_blocks(model)
    refuse_if_sere_installed(blocks)
    seqs, data_meta = calibration_data(tokenizer, text_path, text_field, max_tokens, max_seq_len)
    hidden = collect_moe_inputs(model, seqs, blocks)
    it = blocks
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(blocks, desc="SERE protection", unit="layer")
    protected, scores = {}, {}
    for ref in it:
        if ref.layer not in similarity:
            raise ValueError(f"no similarity matrix for MoE layer {ref.layer}")
        st = expert_damage(ref.block, hidden[ref.layer], similarity[ref.layer], k_primary, rho,
                           batch_size=batch_size, seed=seed, router=ref.gate, rule=ref.rule)
        scores[ref.layer] = st
        protected[ref.layer] = top_n_mask(st[rank_by], n)
    meta = {
        "kind": "sere_protection",
        "definition": ("damage(e) = sum over calibration tokens t with e in a secondary slot of "
                       "||MoE_t(only e's slot re-routed) - MoE_t|| / ||MoE_t||; total = / all tokens, "
                       "mean = / tokens routed to e; top-n by rank_by"),
        "algo_version": ALGO_VERSION,
        "model_id": model_id,
        "model_fingerprint": model_fingerprint(model),
        "similarity_hash": similarity_hash(similarity),
        **data_meta,
        "k_primary": k_primary,
        "rho": float(rho),
        "n": n,
        "batch_size": batch_size,
        "seed": seed,
        "rank_by": rank_by,
        "layers": [ref.layer for ref in blocks],
        "num_experts": blocks[0].num_experts,
        "date": _now(),
        "harness_version": _harness_version(),
    }
    return protected, scores, meta


def save_protection(path: str | Path, protected: dict[int, torch.Tensor], meta: dict[str, Any] | None = None,
                    scores: dict[int, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write ``protected.<layer>`` bool [E] (+ ``damage_total/mean.<layer>`` when ``scores``) + metadata."""
    meta = dict(meta or {})
    meta.setdefault("kind", "sere_protection")
    meta["layers"] = sorted(int(k) for k in protected)
    tensors = {f"protected.{int(k)}": v.to(torch.bool) for k, v in protected.items()}
    for layer, st in (scores or {}).items():
        for key in ("total", "mean"):
            tensors[f"damage_{key}.{int(layer)}"] = st[key].to(torch.float64)
    return _atomic_save(path, tensors, meta)


def load_protection(path: str | Path, n: int | None = None) -> tuple[dict[int, torch.Tensor], dict[str, Any]]:
    """``({layer: bool [E]}, meta)``. With ``n`` different from the stored one, the top-n is re-derived
    from the stored scores (ranked as the file was: ``meta["rank_by"]``)."""
    tensors, meta = _read(path)
    prot = {int(k.split(".", 1)[1]): v.to(torch.bool) for k, v in tensors.items() if k.startswith("protected.")}
    if not prot:
        raise ValueError(f"{path}: no protection tensors")
    if n is not None and any(int(v.sum()) != n for v in prot.values()):
        rank_by = meta.get("rank_by", "total")
        missing = [l for l in prot if f"damage_{rank_by}.{l}" not in tensors]
        if missing:
            raise ValueError(f"{path}: built for n={meta.get('n')}, has no scores to derive n={n}")
        prot = {l: top_n_mask(tensors[f"damage_{rank_by}.{l}"], n) for l in prot}
        meta = {**meta, "n": n}
    return dict(sorted(prot.items())), meta


def protection_cache_path(model: torch.nn.Module, model_id: str, similarity: dict[int, torch.Tensor],
                          k_primary: int, rho: float, cache_dir: str | Path | None = None,
                          text_path: str | Path | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                          batch_size: int = DEFAULT_BATCH_SIZE, rank_by: str = "total",
                          text_field: str | None = None) -> Path:
    """Cache file of the damage scores; ``n`` is not part of the key (the top-n is derived on load)."""
    sha = calibration_source_sha256(text_path, text_field)
    name = (f"prot-{_slug(model_id)}-{model_fingerprint(model)[:12]}-{similarity_hash(similarity)[:12]}"
            f"-{sha[:12]}-k{k_primary}-r{float(rho):g}-b{batch_size}-t{max_tokens}-{rank_by}"
            f"-v{ALGO_VERSION}.safetensors")
    return Path(cache_dir or default_sere_cache_dir()) / name


def protection_for(model: torch.nn.Module, tokenizer: Any, model_id: str, similarity: dict[int, torch.Tensor],
                   k_primary: int, rho: float, n: int, cache_dir: str | Path | None = None,
                   text_path: str | Path | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                   batch_size: int = DEFAULT_BATCH_SIZE, rank_by: str = "total",
                   progress: bool = False, text_field: str | None = None) -> dict[int, torch.Tensor]:
    """Protected experts ({layer: bool [E]}, ``n`` per layer): from the cache, or built then cached."""
    path = protection_cache_path(model, model_id, similarity, k_primary, rho, cache_dir, text_path,
                                 max_tokens, batch_size, rank_by, text_field)
    if path.exists():
        try:
            return load_protection(path, n=n)[0]
        except Exception:  # noqa: BLE001 - a damaged cache entry is rebuilt
            pass
    prot, scores, meta = compute_protection(model, tokenizer, similarity, k_primary, rho, n, text_path=text_path,
                                            max_tokens=max_tokens, batch_size=batch_size, rank_by=rank_by,
                                            model_id=model_id, progress=progress, text_field=text_field)
    save_protection(path, prot, meta, scores)
    return prot
