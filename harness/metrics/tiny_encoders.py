"""Embedded scorer models: a tiny seeded CLIP and a tiny seeded text embedder, built locally on first use.

Why: RAG-IGBench's ``clip_score`` and ``alignment`` need two neural encoders (the paper's OpenAI CLIP ViT-L/14
and ``TencentBAC/Conan-embedding-v1``) that CI cannot download. As with the embedded LLM
(:mod:`harness.models.tiny`), every feature must still run for real on the embedded default, so
``scoring.clip_model=tiny`` / ``scoring.embed_model=tiny`` select these stand-ins. **Their weights are random**
(``"weights": "random-init"`` in ``harness_model.json`` and in :meth:`harness.scoring.Scorer.describe`):
scores computed with them exercise the scoring path (image loading, preprocessing, tokenisation, pooling,
projection, the cosine → score maps, aggregation) and mean nothing. For paper-comparable numbers use
``scoring.clip_model=ViT-L-14 scoring.clip_pretrained=openai scoring.embed_model=TencentBAC/Conan-embedding-v1``.

* :func:`ensure_tiny_clip` — an open_clip ``CLIP`` (ViT image tower 64 px / patch 16, 2-layer text tower of
  width 32, joint dimension 32) written as an open_clip *local directory* (``open_clip_config.json`` +
  ``open_clip_model.safetensors``), loaded with ``ClipScorer("local-dir:<dir>", None)``. It uses open_clip's
  own bundled CLIP BPE tokenizer (byte-level, so Chinese contexts tokenise; nothing is downloaded), hence
  the 49408-token vocabulary. Scoring the 59 images of the bundled RAG-IGBench sample takes well under a
  second on two CPU cores.
* :func:`ensure_tiny_text_embedder` — a 2-layer BERT of width 32 with a byte-level BPE tokenizer trained
  here with ``tokenizers`` on a few lines of Chinese and English (any text encodes, no ``[UNK]``), saved
  with ``save_pretrained`` plus the sentence-transformers module files the real Conan checkpoint has
  (``modules.json``: Transformer → mean Pooling → Dense 32 → 48 with bias → Normalize), so
  ``TextEmbedder(<dir>)`` runs the same pipeline-reading code as for Conan.

Both are pure functions of their spec (the seed included): every floating tensor is drawn from one seeded
generator in sorted parameter-name order (norms 1, biases 0), which does not depend on module init order.
They are cached in ``$HARNESS_CACHE/models`` (default ``~/.cache/moe-vlm-harness/models``) under a name
holding the spec's fingerprint, and built atomically (temporary sibling directory, then rename), so a
killed build never leaves a checkpoint that later runs would trust.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.models.tiny import MARKER, build_once, default_cache_dir

#: The marker written last into a built directory (its presence means "complete").
#: The config value that selects these models (``scoring.clip_model=tiny``, ``scoring.embed_model=tiny``).
TINY = "tiny"
CLIP_WEIGHTS_FILE = "open_clip_model.safetensors"

# Text the embedder's tokenizer is trained on: RAG-IGBench-like Chinese prose around images, English, digits
# and markdown. Byte-level BPE encodes anything; the corpus only decides which pieces get merged.
_TOKENIZER_CORPUS = """\
这是第一张图片，展示了成都火锅的红油锅底和各种新鲜食材，看起来非常好吃。
推荐大家去北京的天安门广场看升旗，早上五点就要出发，记得带上外套。
这家咖啡店的拿铁很好喝，环境也很安静，适合周末一个人来看书。
护肤的第一步是清洁，然后是爽肤水、精华和面霜，最后一定要涂防晒。
健身新手可以先从深蹲、俯卧撑和平板支撑开始，每周练三到四次。
上海外滩的夜景特别漂亮，建议傍晚过去，可以拍到日落和灯光。
这款手机的拍照效果不错，电池续航也很长，但是价格有点贵。
猫咪第一次到家会紧张，要给它准备一个安静的角落和干净的猫砂。
用户问题 笔记 图片 回答 旅游 美食 穿搭 护肤 健身 数码 家居 理财 教育 宠物 摄影 面包 蛋糕 城市 公园 海边 山 雪 花 狗
The first picture shows the hotpot with fresh ingredients; the second one is the view from the hotel room.
Start with squats, push-ups and planks three times a week, then add weights when it gets easy.
what-is how-to yes-or-no head-to-head Finance Food Travel Beauty Tech Home Sports
0 1 2 3 4 5 6 7 8 9 10 20 100 2024 2025 ![图](IMG#1) <sup>[1](DOC#1)</sup> [ ] { } " : , 。 ， ！ ？ 、 ；
"""
_EMBEDDER_SPECIAL_TOKENS = ("[PAD]", "[CLS]", "[SEP]", "[MASK]")


def _fingerprint(spec: Any, *extra: str) -> str:
    blob = json.dumps(dataclasses.asdict(spec), sort_keys=True) + "".join(extra)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TinyClipSpec:
    """Every number that decides the tiny CLIP; its hash names the cache directory."""

    seed: int = 0
    embed_dim: int = 32
    image_size: int = 64
    patch_size: int = 16
    vision_width: int = 32
    vision_layers: int = 2
    vision_head_width: int = 16
    text_width: int = 32
    text_heads: int = 2
    text_layers: int = 2
    context_length: int = 77
    vocab_size: int = 49408  # ids of open_clip's bundled SimpleTokenizer (CLIP BPE)
    format_version: int = 1  # bump when the writer changes the files it produces

    def fingerprint(self) -> str:
        return _fingerprint(self)

    def model_cfg(self) -> dict[str, Any]:
        """open_clip ``model_cfg`` (the schema of open_clip's built-in ``model_configs/*.json``)."""
        return {
            "embed_dim": self.embed_dim,
            "vision_cfg": {"image_size": self.image_size, "layers": self.vision_layers, "width": self.vision_width,
                           "patch_size": self.patch_size, "head_width": self.vision_head_width},
            "text_cfg": {"context_length": self.context_length, "vocab_size": self.vocab_size,
                         "width": self.text_width, "heads": self.text_heads, "layers": self.text_layers},
        }

    def preprocess_cfg(self) -> dict[str, Any]:
        """The OpenAI CLIP preprocessing (shortest side resize, bicubic, centre crop, CLIP mean/std) at our size."""
        return {"size": self.image_size, "mode": "RGB", "mean": [0.48145466, 0.4578275, 0.40821073],
                "std": [0.26862954, 0.26130258, 0.27577711], "interpolation": "bicubic",
                "resize_mode": "shortest"}


@dataclass(frozen=True)
class TinyTextEmbedderSpec:
    """Every number that decides the tiny text embedder; its hash (with the corpus) names the cache directory."""

    seed: int = 0
    vocab_size: int = 1024  # upper bound for the BPE trainer; the small corpus may give fewer
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 64
    max_position_embeddings: int = 512
    dense_out: int = 48  # Dense projection after pooling, as Conan's (1024 → 1792, with bias)
    format_version: int = 1

    def fingerprint(self) -> str:
        return _fingerprint(self, _TOKENIZER_CORPUS)


def clip_dir_name(spec: TinyClipSpec | None = None) -> str:
    """The cache directory name (and identity in results) of a tiny CLIP, computed without building it."""
    return f"tiny-clip-{(spec or TinyClipSpec()).fingerprint()}"


def text_embedder_dir_name(spec: TinyTextEmbedderSpec | None = None) -> str:
    """The cache directory name (and identity in results) of a tiny text embedder, without building it."""
    return f"tiny-text-embedder-{(spec or TinyTextEmbedderSpec()).fingerprint()}"


def seeded_init(model: Any, seed: int) -> None:
    """Deterministic random weights drawn from one seeded generator in sorted parameter-name order.

    LayerNorm weights 1 and all biases 0; ``logit_scale`` (CLIP) log(1/0.07), its usual initial value;
    embedding tables (token, position, class) N(0, 1); every other tensor N(0, 1/fan_in) with fan_in the
    product of all but the first dimension. Independent of module construction order and library version.
    """
    import torch

    norm_params = {f"{mname}.{pname}" if mname else pname
                   for mname, mod in model.named_modules() if isinstance(mod, torch.nn.LayerNorm)
                   for pname, _ in mod.named_parameters(recurse=False)}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name in norm_params:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            elif name == "logit_scale":
                param.fill_(math.log(1 / 0.07))
            else:
                embedding = "embedding" in name or name.endswith("class_embedding")
                fan_in = math.prod(param.shape[1:]) if param.dim() > 1 else param.numel()
                std = 1.0 if embedding else 1.0 / max(fan_in, 1) ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)


# ------------------------------------------------------------------------------------------------- CLIP


def build_tiny_clip(out_dir: str | Path, spec: TinyClipSpec | None = None) -> Path:
    """Write the tiny CLIP as an open_clip local directory (config, safetensors weights, marker)."""
    from open_clip.model import CLIP
    from safetensors.torch import save_file

    spec = spec or TinyClipSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = CLIP(**spec.model_cfg())
    seeded_init(model, spec.seed)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / CLIP_WEIGHTS_FILE),
              metadata={"format": "pt"})
    (out / "open_clip_config.json").write_text(json.dumps(
        {"model_cfg": spec.model_cfg(), "preprocess_cfg": spec.preprocess_cfg()}, indent=2) + "\n")
    (out / MARKER).write_text(json.dumps(
        {"name": "tiny-clip", "weights": "random-init", "fingerprint": spec.fingerprint(),
         "spec": dataclasses.asdict(spec),
         "note": "random weights: scores exercise the CLIP-score path and mean nothing"}, indent=2) + "\n")
    return out


def ensure_tiny_clip(cache_dir: str | Path | None = None, seed: int = 0,
                     spec: TinyClipSpec | None = None) -> tuple[str, str]:
    """``(model_name, checkpoint_path)`` of the tiny CLIP, building it on first use.

    ``model_name`` is open_clip's ``"local-dir:<directory>"`` (config and weights read from there): use it as
    ``ClipScorer(model_name, None)`` or ``open_clip.create_model_and_transforms(model_name)`` and
    ``open_clip.get_tokenizer(model_name)``. ``checkpoint_path`` is the safetensors file inside it.
    """
    spec = spec or TinyClipSpec(seed=seed)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = build_once(root / clip_dir_name(spec), lambda tmp: build_tiny_clip(tmp, spec))
    return f"local-dir:{target}", str(target / CLIP_WEIGHTS_FILE)


# --------------------------------------------------------------------------------------- text embedder


def build_embedder_tokenizer(spec: TinyTextEmbedderSpec):
    """A byte-level BPE tokenizer trained locally, BERT-style ``[CLS] … [SEP]`` framing, ``[PAD]`` right."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=list(_EMBEDDER_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([l for l in _TOKENIZER_CORPUS.splitlines() if l.strip()], trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
        unk_token=None, model_max_length=spec.max_position_embeddings, padding_side="right")


def build_tiny_text_embedder(out_dir: str | Path, spec: TinyTextEmbedderSpec | None = None) -> Path:
    """Write the tiny embedder: a transformers BERT checkpoint plus sentence-transformers module files."""
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    spec = spec or TinyTextEmbedderSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_embedder_tokenizer(spec)
    config = BertConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings, pad_token_id=tokenizer.pad_token_id)
    model = BertModel(config).to(torch.float32).eval()
    seeded_init(model, spec.seed)
    dense = torch.nn.Linear(spec.hidden_size, spec.dense_out, bias=True)
    gen = torch.Generator().manual_seed(spec.seed + 1)  # its own stream: independent of BERT's parameter count
    with torch.no_grad():
        dense.weight.copy_(torch.randn(dense.weight.shape, generator=gen) / spec.hidden_size ** 0.5)
        dense.bias.copy_(torch.randn(dense.bias.shape, generator=gen) * 0.1)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)

    def write(rel: str, obj: Any) -> None:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(json.dumps(obj, indent=2) + "\n")

    write("modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write("sentence_bert_config.json", {"max_seq_length": spec.max_position_embeddings, "do_lower_case": False})
    write("1_Pooling/config.json", {"word_embedding_dimension": spec.hidden_size, "pooling_mode_cls_token": False,
                                    "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False})
    write("2_Dense/config.json", {"in_features": spec.hidden_size, "out_features": spec.dense_out, "bias": True,
                                  "activation_function": "torch.nn.modules.linear.Identity"})
    save_file({"linear.weight": dense.weight.detach().contiguous(), "linear.bias": dense.bias.detach().contiguous()},
              str(out / "2_Dense" / "model.safetensors"), metadata={"format": "pt"})
    (out / "3_Normalize").mkdir(exist_ok=True)
    write(MARKER, {"name": "tiny-text-embedder", "weights": "random-init", "fingerprint": spec.fingerprint(),
                   "spec": dataclasses.asdict(spec),
                   "note": "random weights: alignment scores exercise the path and mean nothing"})
    return out


def ensure_tiny_text_embedder(cache_dir: str | Path | None = None, seed: int = 0,
                              spec: TinyTextEmbedderSpec | None = None) -> str:
    """Directory of the tiny text embedder (``TextEmbedder(path)`` loads it), building it on first use."""
    spec = spec or TinyTextEmbedderSpec(seed=seed)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return str(build_once(root / text_embedder_dir_name(spec), lambda tmp: build_tiny_text_embedder(tmp, spec)))


def weights_label(path: str | Path | None) -> str | None:
    """``weights`` recorded in a local directory's ``harness_model.json`` (``"random-init"``), else None."""
    if not path:
        return None
    marker = Path(str(path).removeprefix("local-dir:")) / MARKER
    try:
        return json.loads(marker.read_text()).get("weights")
    except (OSError, ValueError):
        return None
