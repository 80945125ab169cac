"""SERE calibration: the per-layer expert similarity matrices, computed once per model and cached.

Definition (arXiv 2602.07616, ``shared/notes/techniques.md``). For one MoE layer, run *every* expert on
the same calibration tokens (a dense pass, gate weights not applied): ``O_i`` [tokens x hidden] is expert
i's output. Then

    d_ij   = ||O_i - O_j||_F
    sim_ij = 1 - d_ij / max_{a != b} d_ab        (per layer; diagonal 1; range [0, 1])

The input of a layer's experts is what that layer's MoE block receives in the *stock* model (forward
pre-hooks on the blocks while the model reads the calibration text), so the hidden states are the real
distribution at that depth.

Memory: the E output matrices are never held at once. Tokens are processed in chunks; each chunk's
outputs [E, T, H] are flattened to [E, T*H] and their Gram matrix is added to a float64 accumulator
``G`` (E x E). Since ``||O_i - O_j||^2 = G_ii + G_jj - 2 G_ij``, G is all that is needed. float64 keeps
the cancellation in that difference harmless (experts whose outputs are close).

Calibration data (``sere.calibration_text`` / ``--text``; :func:`iter_calibration_documents`): the shipped
``data/sere_calibration.txt`` (generic educational English + Chinese prose written for this project, ~3k
tokens: enough for the embedded model, far below a real model's budget) or **the user's data**: a UTF-8 text
file (documents separated by blank lines), a ``.jsonl`` file (one document per line: a JSON string or an
object whose ``text`` field — or ``content`` / ``document``, or ``sere.calibration_field`` — holds it, e.g.
a FineWeb-Edu sample), a ``.json`` file holding a list of such documents, or a directory of those files
(sorted by name). Each document is tokenised on its own (no special tokens added beyond what the tokenizer
adds by default), truncated to ``max_seq_len`` = 512 tokens (as the paper truncates its FineWeb-Edu
documents), and documents are taken in order until ``max_tokens`` tokens are collected (the last one cut to
fit). The default budget is the reference's **32 x 512 = 16,384 tokens** (``sere.calibration_tokens``,
``--max-tokens``); data that runs out first is used whole, and the artifact's metadata says so
(``tokens`` used, ``max_tokens`` asked, ``budget_met``, ``calibration_source``) with a logged warning. Each
document is one forward pass of batch 1, so there is no padding to mask. The cache key hashes the data
files' bytes and the text field.

MoE blocks are found generically (Qwen3-MoE, Qwen3-VL-MoE, any module with ``.gate`` and ``.experts``
whose ``gate_up_proj`` is 3-D); a block's key is its decoder-layer index parsed from its module name
(``...layers.<i>.mlp``), the same index vLLM's ``prefix`` carries, so one artifact serves both engines.

Artifacts: safetensors with one float32 ``similarity.<layer>`` [E, E] tensor per MoE layer; the JSON
metadata (model id and fingerprint, calibration sha256, token count, layers, date, harness version) is
stored in the safetensors header under ``harness_sere`` and copied to ``<file>.json`` for reading.

CLI: ``python -m harness.commands.sere_calibrate --model PATH --out FILE [--text FILE|DIR]
[--text-field NAME] [--max-tokens N] [--max-seq-len 512] [--device auto] [--dtype auto]``.

Only torch and the standard library are imported at module level.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from harness.models.load import load_model_for_calibration  # noqa: F401 (lives with the model loading)
from harness.models.moe_blocks import (  # noqa: F401 (model-structure helpers, re-exported)
    _LAYER_RE,
    MoeBlockRef,
    _is_moe_block,
    find_moe_blocks,
    model_fingerprint,
)
from harness import __version__
from harness.config.paths import open_new, remove_stale_temporaries, write_atomic

__all__ = [
    "ALGO_VERSION", "DEFAULT_TEXT_PATH", "MoeBlockRef", "calibration_sequences", "collect_moe_inputs",
    "iter_calibration_documents", "calibration_source_sha256",
    "compute_similarity", "default_sere_cache_dir", "expert_gram", "expert_outputs", "find_moe_blocks",
    "load_calibration_text", "load_similarity", "model_fingerprint", "save_similarity",
    "similarity_for", "similarity_from_gram",
]

ALGO_VERSION = 1  # bump when the definition or the data pipeline changes: invalidates cached matrices
DEFAULT_TEXT_PATH = Path(__file__).with_name("data") / "sere_calibration.txt"
DEFAULT_MAX_SEQ_LEN = 512
DEFAULT_MAX_TOKENS = 32 * DEFAULT_MAX_SEQ_LEN  # the reference: 32 documents x 512 tokens
TEXT_FIELDS = ("text", "content", "document")
DATA_SUFFIXES = (".txt", ".md", ".jsonl", ".json")
logger = logging.getLogger("harness.sere_calibration")
_META_KEY = "harness_sere"
_GRAM_BUDGET_BYTES = 256 << 20  # per dense chunk: E x T x max(H, 2I) float64 values


# ---------------------------------------------------------------------------------------------------
# Calibration data
# ---------------------------------------------------------------------------------------------------
def _data_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in DATA_SUFFIXES)
        if not files:
            raise ValueError(f"calibration data directory {path} has no {'/'.join(DATA_SUFFIXES)} files")
        return files
    if not path.is_file():
        raise FileNotFoundError(f"calibration data {path} does not exist (sere.calibration_text / --text)")
    return [path]


def calibration_source_sha256(path: str | Path | None = None, text_field: str | None = None) -> str:
    """sha256 over the data files' names (for a directory) and bytes, and the text field: the cache key."""
    path = Path(path or DEFAULT_TEXT_PATH)
    h = hashlib.sha256()
    files = _data_files(path)
    for f in files:
        if len(files) > 1 or path.is_dir():
            h.update(f"{f.name}\0".encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    if text_field:
        h.update(f"\0field={text_field}".encode())
    return h.hexdigest()


def _document_text(obj: Any, where: str, text_field: str | None) -> str:
    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict):
        fields = (text_field,) if text_field else TEXT_FIELDS
        for name in fields:
            if isinstance(obj.get(name), str):
                return obj[name]
        raise ValueError(f"{where}: no text field {' / '.join(fields)} (set sere.calibration_field / --text-field)")
    raise ValueError(f"{where}: a document must be a string or an object with a text field, got {type(obj).__name__}")


def iter_calibration_documents(path: str | Path | None = None, text_field: str | None = None):
    """Documents (strings) of the calibration data, in order, read lazily (module doc for the formats)."""
    for f in _data_files(Path(path or DEFAULT_TEXT_PATH)):
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            with open(f, encoding="utf-8") as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise ValueError(f"{f}:{n}: not JSON ({e.msg})") from None
                        yield _document_text(obj, f"{f}:{n}", text_field)
        elif suffix == ".json":
            data = json.loads(f.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise ValueError(f"{f}: expected a JSON list of documents")
            for n, obj in enumerate(data):
                yield _document_text(obj, f"{f}[{n}]", text_field)
        else:
            yield from (p.strip() for p in re.split(r"\n\s*\n", f.read_text(encoding="utf-8")) if p.strip())


def load_calibration_text(path: str | Path | None = None) -> tuple[str, str]:
    """(text, sha256 of the file's bytes) of a plain-text calibration file; the shipped text by default."""
    raw = Path(path or DEFAULT_TEXT_PATH).read_bytes()
    return raw.decode("utf-8"), hashlib.sha256(raw).hexdigest()


def _text_tokenizer(tokenizer: Any) -> Any:
    """A processor carries its tokenizer in ``.tokenizer``; a tokenizer is used as it is."""
    inner = getattr(tokenizer, "tokenizer", None)
    return inner if inner is not None and callable(inner) else tokenizer


def calibration_sequences(tokenizer: Any, text: Any, max_tokens: int = DEFAULT_MAX_TOKENS,
                          max_seq_len: int = DEFAULT_MAX_SEQ_LEN) -> list[torch.Tensor]:
    """Token id sequences (1-D int64): documents in order, each truncated to ``max_seq_len``, until
    ``max_tokens`` ids in total (the last sequence is cut to fit). ``text``: one string (its blank-line
    separated paragraphs are the documents) or an iterable of documents (read only as far as needed)."""
    if max_tokens < 1 or max_seq_len < 1:
        raise ValueError(f"max_tokens and max_seq_len must be >= 1, got {max_tokens}, {max_seq_len}")
    tok = _text_tokenizer(tokenizer)
    docs = (p.strip() for p in re.split(r"\n\s*\n", text)) if isinstance(text, str) else (str(d).strip() for d in text)
    seqs: list[torch.Tensor] = []
    left = max_tokens
    for doc in docs:
        if not doc:
            continue
        ids = list(tok(doc)["input_ids"])[: min(max_seq_len, left)]
        if not ids:
            continue
        seqs.append(torch.tensor(ids, dtype=torch.long))
        left -= len(ids)
        if left <= 0:
            break
    if not seqs:
        raise ValueError("the calibration text produced no tokens")
    return seqs


def calibration_data(tokenizer: Any, text_path: str | Path | None = None, text_field: str | None = None,
                     max_tokens: int = DEFAULT_MAX_TOKENS, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                     ) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """(sequences, metadata) of the calibration data: what was asked, what was used, whether the budget was
    met (a warning is logged when the data runs out first)."""
    seqs = calibration_sequences(tokenizer, iter_calibration_documents(text_path, text_field),
                                 max_tokens=max_tokens, max_seq_len=max_seq_len)
    used = int(sum(s.numel() for s in seqs))
    source = str(text_path) if text_path else "shipped:" + DEFAULT_TEXT_PATH.name
    if used < max_tokens:
        logger.warning("SERE calibration: %s gave %d tokens, fewer than the budget of %d (the reference uses "
                       "32 x 512 = 16384): set sere.calibration_text / --text to more data", source, used,
                       max_tokens)
    return seqs, {"calibration_sha256": calibration_source_sha256(text_path, text_field),
                  "calibration_file": str(text_path or DEFAULT_TEXT_PATH), "calibration_source": source,
                  "calibration_field": text_field, "tokens": used, "sequences": len(seqs),
                  "max_tokens": max_tokens, "max_seq_len": max_seq_len, "budget_met": used >= max_tokens}


def _model_device(model: torch.nn.Module) -> torch.device:
    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next(model.parameters()).device


def refuse_if_sere_installed(blocks: list[MoeBlockRef]) -> None:
    """Calibration must see the stock routing: refuse a model carrying SERE hooks (``hf_sere``)."""
    for ref in blocks:
        if getattr(ref.block, "_harness_sere", None) is not None or getattr(ref.block, "_harness_topk", None):
            raise RuntimeError(f"SERE hooks are installed on {ref.name}: remove() them before calibrating")


def collect_moe_inputs(model: torch.nn.Module, sequences: list[torch.Tensor],
                       blocks: list[MoeBlockRef] | None = None,
                       store_device: str | torch.device = "cpu") -> dict[int, torch.Tensor]:
    """Input hidden states [N, H] of every MoE block while the model reads ``sequences`` (batch 1 each).

    Forward pre-hooks on the blocks; stored on ``store_device`` in the model's dtype, rows in token order.
    """
    blocks = find_moe_blocks(model) if blocks is None else blocks
    if not blocks:
        raise ValueError("no MoE block (module with .gate and .experts.gate_up_proj [E, 2I, H]) found")
    refuse_if_sere_installed(blocks)
    got: dict[int, list[torch.Tensor]] = {ref.layer: [] for ref in blocks}
    hooks = []

    def make_hook(layer: int):
        def hook(module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            got[layer].append(hs.detach().reshape(-1, hs.shape[-1]).to(store_device))
        return hook

    for ref in blocks:
        hooks.append(ref.block.register_forward_pre_hook(make_hook(ref.layer), with_kwargs=True))
    device = _model_device(model)
    try:
        with torch.inference_mode():
            for ids in sequences:
                ids = ids.reshape(1, -1).to(device)
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return {layer: torch.cat(parts) for layer, parts in got.items()}


# ---------------------------------------------------------------------------------------------------
# Dense expert pass and the Gram matrix
# ---------------------------------------------------------------------------------------------------
def _standard_layout(experts: torch.nn.Module) -> bool:
    """Fused Qwen-style experts: gate_up_proj [E, 2I, H] (gate then up), down_proj [E, H, I], no bias."""
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (
        isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.dim() == 3 and down.dim() == 3
        and callable(getattr(experts, "act_fn", None))
        and not getattr(experts, "is_transposed", False) and not getattr(experts, "has_bias", False)
        and getattr(experts, "has_gate", True) and getattr(experts, "is_concatenated", True)
        and gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1]
    )


def expert_outputs(experts: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Output of every expert on every row of ``x`` [T, H], no gate weight applied: [E, T, H].

    Standard fused layout: two batched matmuls (``act(x W_gate^T) * (x W_up^T) W_down^T`` per expert).
    Any other layout: the module's own forward, once per expert, with every token routed to that expert
    at weight 1 (slower, but whatever the experts implementation does).
    """
    gu = experts.gate_up_proj
    x = x.to(device=gu.device, dtype=gu.dtype)
    if _standard_layout(experts):
        h = torch.matmul(x, gu.transpose(1, 2))                       # [E, T, 2I]
        gate, up = h.chunk(2, dim=-1)
        return torch.matmul(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2))  # [E, T, H]
    num_experts, t = gu.shape[0], x.shape[0]
    ones = torch.ones(t, 1, dtype=x.dtype, device=x.device)
    return torch.stack([experts(x, torch.full((t, 1), e, dtype=torch.long, device=x.device), ones)
                        for e in range(num_experts)])


def _auto_chunk(experts: torch.nn.Module, budget_bytes: int = _GRAM_BUDGET_BYTES) -> int:
    e, two_i, h = experts.gate_up_proj.shape
    return max(1, budget_bytes // (e * max(h, two_i) * 8))


def expert_gram(experts: torch.nn.Module, hidden: torch.Tensor, chunk_tokens: int | None = None) -> torch.Tensor:
    """float64 Gram matrix [E, E] of the experts' flattened outputs on ``hidden`` [N, H], chunk by chunk:
    ``G_ij = <O_i, O_j>_F``, never holding more than one chunk's outputs."""
    chunk = chunk_tokens or _auto_chunk(experts)
    num_experts = experts.gate_up_proj.shape[0]
    gram = torch.zeros(num_experts, num_experts, dtype=torch.float64, device=experts.gate_up_proj.device)
    with torch.inference_mode():
        for start in range(0, hidden.shape[0], chunk):
            out = expert_outputs(experts, hidden[start:start + chunk])
            flat = out.reshape(num_experts, -1).to(torch.float64)
            gram += flat @ flat.T
    return gram


def similarity_from_gram(gram: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(sim [E, E] float64, max off-diagonal distance) from a Gram matrix of flattened outputs.

    ``d_ij = sqrt(max(G_ii + G_jj - 2 G_ij, 0))``; ``sim = 1 - d / max_{a != b} d``, diagonal 1. All
    experts identical (max distance 0) or a single expert: every similarity is 1.
    """
    g = gram.to(torch.float64)
    g = (g + g.T) / 2
    diag = g.diagonal()
    d = (diag[:, None] + diag[None, :] - 2 * g).clamp_min(0).sqrt()
    d.fill_diagonal_(0)
    num_experts = d.shape[0]
    dmax = float(d.max()) if num_experts > 1 else 0.0
    sim = torch.ones_like(d) if dmax == 0.0 else 1 - d / dmax
    sim.fill_diagonal_(1.0)
    return sim, dmax


# ---------------------------------------------------------------------------------------------------
# The whole computation
# ---------------------------------------------------------------------------------------------------
def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _harness_version() -> str:
    return __version__


def compute_similarity(model: torch.nn.Module, tokenizer: Any, *, text_path: str | Path | None = None,
                       max_tokens: int = DEFAULT_MAX_TOKENS, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                       chunk_tokens: int | None = None, model_id: str | None = None,
                       progress: bool = False, text_field: str | None = None,
                       ) -> tuple[dict[int, torch.Tensor], dict[str, Any]]:
    """Similarity matrices of every MoE layer ({layer: float32 [E, E] on CPU}) and their metadata."""
    seqs, data_meta = calibration_data(tokenizer, text_path, text_field, max_tokens, max_seq_len)
    blocks = find_moe_blocks(model)
    hidden = collect_moe_inputs(model, seqs, blocks)
    it = blocks
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(blocks, desc="SERE similarity", unit="layer")
    sims: dict[int, torch.Tensor] = {}
    dmax: dict[str, float] = {}
    for ref in it:
        gram = expert_gram(ref.block.experts, hidden[ref.layer], chunk_tokens)
        sim, scale = similarity_from_gram(gram)
        sims[ref.layer] = sim.to(device="cpu", dtype=torch.float32)
        dmax[str(ref.layer)] = scale
    dtype = str(blocks[0].block.experts.gate_up_proj.dtype).removeprefix("torch.")
    meta = {
        "kind": "sere_similarity",
        "definition": "sim_ij = 1 - ||O_i - O_j||_F / max_{a!=b} ||O_a - O_b||_F, diagonal 1",
        "algo_version": ALGO_VERSION,
        "model_id": model_id,
        "model_fingerprint": model_fingerprint(model),
        **data_meta,
        "layers": [ref.layer for ref in blocks],
        "num_experts": blocks[0].num_experts,
        "dtype": dtype,
        "max_distance": dmax,
        "date": _now(),
        "harness_version": _harness_version(),
    }
    return sims, meta


# ---------------------------------------------------------------------------------------------------
# Artifacts (shared with sere_protection)
# ---------------------------------------------------------------------------------------------------
def _atomic_save(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    import socket
    import uuid

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # a build killed before its rename left its temporary file in the (shared) cache forever: the name says host
    # and pid, so the next save removes this host's dead writers' leftovers
    remove_stale_temporaries(path.parent, path.name)
    blob = json.dumps(meta, sort_keys=True)
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    os.close(open_new(tmp, 0o644))  # created here (O_EXCL | O_NOFOLLOW): safetensors then writes a file of ours
    try:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata={_META_KEY: blob})
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    write_atomic(Path(str(path) + ".json"), (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode("utf-8"))
    return path


def _read(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(header[_META_KEY]) if _META_KEY in header else {}
    return tensors, meta


def save_similarity(path: str | Path, similarity: dict[int, torch.Tensor], meta: dict[str, Any] | None = None) -> Path:
    """Write ``{layer: [E, E]}`` as float32 ``similarity.<layer>`` tensors plus JSON metadata."""
    meta = dict(meta or {})
    meta.setdefault("kind", "sere_similarity")
    meta["layers"] = sorted(int(k) for k in similarity)
    return _atomic_save(path, {f"similarity.{int(k)}": v.to(torch.float32) for k, v in similarity.items()}, meta)


def load_similarity(path: str | Path) -> tuple[dict[int, torch.Tensor], dict[str, Any]]:
    """``({layer: float32 [E, E]}, meta)``. Also reads a single ``similarity`` [L, E, E] tensor, its
    layers taken from ``meta["layers"]`` (or 0..L-1)."""
    tensors, meta = _read(path)
    if "similarity" in tensors:
        stack = tensors["similarity"]
        layers = meta.get("layers") or list(range(stack.shape[0]))
        return {int(l): stack[i].float() for i, l in enumerate(layers)}, meta
    sims = {int(k.split(".", 1)[1]): v.float() for k, v in tensors.items() if k.startswith("similarity.")}
    if not sims:
        raise ValueError(f"{path}: no similarity tensors")
    return dict(sorted(sims.items())), meta


def default_sere_cache_dir() -> Path:
    """``$HARNESS_CACHE/sere`` or ``~/.cache/moe-vlm-harness/sere``."""
    root = os.environ.get("HARNESS_CACHE") or os.path.join(Path.home(), ".cache", "moe-vlm-harness")
    return Path(root) / "sere"


def _slug(s: str, limit: int = 60) -> str:
    s = re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("._-")
    return (s[-limit:] if len(s) > limit else s) or "model"


def similarity_cache_path(model: torch.nn.Module, model_id: str, cache_dir: str | Path | None = None,
                          text_path: str | Path | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                          max_seq_len: int = DEFAULT_MAX_SEQ_LEN, text_field: str | None = None) -> Path:
    """Cache file of a model's matrices: key = model id + fingerprint + calibration hash + budget."""
    sha = calibration_source_sha256(text_path, text_field)
    name = (f"sim-{_slug(model_id)}-{model_fingerprint(model)[:12]}-{sha[:12]}"
            f"-t{max_tokens}-s{max_seq_len}-v{ALGO_VERSION}.safetensors")
    return Path(cache_dir or default_sere_cache_dir()) / name


def check_similarity(model: torch.nn.Module, similarity: dict[int, torch.Tensor]) -> None:
    """Every MoE layer of ``model`` has an [E, E] matrix, and no other layer is present."""
    blocks = find_moe_blocks(model)
    want = {ref.layer: ref.num_experts for ref in blocks}
    if set(similarity) != set(want):
        raise ValueError(f"similarity layers {sorted(similarity)} != the model's MoE layers {sorted(want)}")
    for layer, e in want.items():
        if tuple(similarity[layer].shape) != (e, e):
            raise ValueError(f"layer {layer}: similarity {tuple(similarity[layer].shape)}, model has {e} experts")


def similarity_for(model: torch.nn.Module, tokenizer: Any, model_id: str, cache_dir: str | Path | None = None,
                   text_path: str | Path | None = None, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                   max_seq_len: int = DEFAULT_MAX_SEQ_LEN, progress: bool = False,
                   text_field: str | None = None) -> dict[int, torch.Tensor]:
    """The model's similarity matrices: read from the cache, or computed (then cached) on first use."""
    path = similarity_cache_path(model, model_id, cache_dir, text_path, max_tokens, max_seq_len, text_field)
    if path.exists():
        try:
            sims, _ = load_similarity(path)
            check_similarity(model, sims)
            return sims
        except Exception:  # noqa: BLE001 - a damaged cache entry is recomputed, not trusted
            pass
    sims, meta = compute_similarity(model, tokenizer, text_path=text_path, max_tokens=max_tokens,
                                    max_seq_len=max_seq_len, model_id=model_id, progress=progress,
                                    text_field=text_field)
    save_similarity(path, sims, meta)
    return sims
