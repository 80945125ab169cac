"""Tiny seeded random checkpoints of every family (``model=<family>_tiny_random``; tests), built locally.

``ensure_tiny_family(name, seed[, multimodal])`` writes ``$HARNESS_CACHE/models/tiny-<family>[-vl]-<hash>/`` once (atomically,
``harness.models.tiny.build_once``): the family's transformers config at tiny sizes (``MoeFamily.tiny``: vocab
1024, hidden 64, 2 layers, head_dim >= 32, 8 experts, top-4, never ``hidden == 2 * moe_intermediate``), weights
drawn by sorted name from one seeded generator (norms 1; routers sharper than uniform; router and selection
biases random, so a bias that ranks is exercised), saved by ``save_pretrained`` in the checkpoint layout vLLM's
loaders read (transformers writes the original per-expert names), the config keys spelt for older
transformers too, and the byte-level tokenizer of the embedded model with its chat template.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from harness.models.families import get
from harness.models.tiny import MARKER, TinyModelSpec, build_once, build_processor, build_tokenizer, default_cache_dir

__all__ = ["FORMAT_VERSION", "build_tiny_family", "ensure_tiny_family", "tiny_family_fingerprint"]

FORMAT_VERSION = 1


#: the tokenizer's special tokens a multimodal config names by id (``MoeFamily.tiny_vl``)
_VL_TOKENS = {"image": "<|image_pad|>", "video": "<|video_pad|>", "vision_start": "<|vision_start|>",
              "vision_end": "<|vision_end|>", "eos": "<|im_end|>", "pad": "<|endoftext|>"}


def tiny_family_fingerprint(name: str, seed: int = 0, multimodal: bool = False) -> str:
    """The checkpoint's identity: family, seed, class and config (a multimodal build: its whole config, the
    tokenizer's ids left out — they follow from the seed — and the tiny embedded model's processor sizes)."""
    fam = get(name)
    config, cls = fam.tiny(seed)
    if multimodal:
        config, cls = fam.tiny_vl(seed, dict.fromkeys(_VL_TOKENS, 0))
    blob = {"family": name, "seed": seed, "cls": cls, "config": config.to_diff_dict(), "format": FORMAT_VERSION}
    if multimodal:
        spec = TinyModelSpec(seed=seed)
        blob.update(multimodal=True, processor=[spec.patch_size, spec.spatial_merge_size, spec.temporal_patch_size,
                                                spec.min_pixels, spec.max_pixels, spec.vocab_size])
    return hashlib.sha256(json.dumps(blob, sort_keys=True, default=str).encode()).hexdigest()[:12]


def ensure_tiny_family(name: str, seed: int = 0, cache_dir: str | Path | None = None, multimodal: bool = False
                       ) -> Path:
    """The directory of family ``name``'s tiny random checkpoint (``multimodal``: with its vision tower and image
    processor), built on first use."""
    fam = get(name)
    if fam.tiny is None:
        raise ValueError(f"model family {name!r} has no tiny random builder here"
                         + (" (the embedded model is model=tiny_random)" if name == "qwen3_vl_moe" else ""))
    if multimodal and fam.tiny_vl is None:
        raise ValueError(f"model family {name!r} has no tiny multimodal builder (model.multimodal=true): its tiny "
                         "model is text-only")
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    tag = "-vl" if multimodal else ""
    return build_once(root / f"tiny-{name}{tag}-{tiny_family_fingerprint(name, seed, multimodal)}",
                      lambda tmp: build_tiny_family(name, tmp, seed, multimodal))


def init_family_weights(model, seed: int) -> None:
    """Every floating tensor (parameters and float buffers such as ``e_score_correction_bias``) drawn by sorted
    name: norms 1, router weights N(0, 16/fan_in), router / selection biases N(0, 0.5), other biases 0 ... as
    ``harness.models.tiny.init_weights`` (the rotary frequencies are left alone)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")})
    with torch.no_grad():
        for name, t in sorted(tensors.items()):
            if not t.is_floating_point():
                continue
            router = ".mlp.gate." in name or ".mlp.router." in name
            if "norm" in name and name.endswith("weight"):
                t.fill_(1.0)
            elif name.endswith("e_score_correction_bias") or (router and name.endswith("bias")):
                t.copy_(torch.randn(t.shape, generator=gen) * 0.5)
            elif name.endswith("bias"):
                t.zero_()
            elif name.endswith("sinks"):
                t.copy_(torch.randn(t.shape, generator=gen))
            else:
                fan_in = t.shape[-1] if t.dim() > 1 else t.numel()
                std = 1.0 / max(fan_in, 1) ** 0.5
                if name.endswith("embed_tokens.weight"):
                    std = 1.0
                elif router:
                    std = 4.0 / max(fan_in, 1) ** 0.5
                t.copy_(torch.randn(t.shape, generator=gen) * std)


def write_compatible_config(path: Path) -> None:
    """``rope_parameters`` (transformers >= 5.20) also as ``rope_theta`` + ``rope_scaling`` for older readers."""
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters")
    if isinstance(rope, dict):
        cfg.setdefault("rope_theta", rope.get("rope_theta"))
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", dict(rope))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_tiny_family(name: str, out_dir: str | Path, seed: int = 0, multimodal: bool = False) -> Path:
    """Write family ``name``'s tiny random checkpoint to ``out_dir`` (module doc); ``multimodal``: the family's
    multimodal layout (``MoeFamily.tiny_vl``) with the tiny embedded model's image processor beside it."""
    import torch
    import transformers

    fam = get(name)
    config, cls = fam.tiny(seed)
    spec = TinyModelSpec(seed=seed, vocab_size=config.vocab_size)
    tok = build_tokenizer(spec)
    if multimodal:  # the multimodal layout names the tokenizer's image and vision markers by id
        config, cls = fam.tiny_vl(seed, {k: tok.convert_tokens_to_ids(v) for k, v in _VL_TOKENS.items()})
    eos, pad = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    config.eos_token_id, config.pad_token_id, config.bos_token_id = eos, pad, None
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(config).to(torch.float32).eval()
    init_family_weights(model, seed)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    model.generation_config.bos_token_id = None
    out = Path(out_dir)
    model.save_pretrained(out)
    write_compatible_config(out / "config.json")
    if multimodal:  # the processor writes the tokenizer too, with the chat template that places the images
        build_processor(spec, tok).save_pretrained(out)
    else:
        tok.save_pretrained(out)
    marker = {"name": f"tiny-{name}" + ("-vl" if multimodal else ""), "family": name, "weights": "random-init",
              "seed": seed, "multimodal": multimodal,
              "fingerprint": tiny_family_fingerprint(name, seed, multimodal), "architecture": cls,
              "parameters": sum(p.numel() for p in model.parameters())}
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out


