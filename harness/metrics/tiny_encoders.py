"""Embedded scorer models: a tiny seeded CLIP and a tiny seeded text embedder, built locally on first use.

Why: RAG-IGBench's ``clip_score`` and ``alignment`` need two neural encoders (the paper's OpenAI CLIP ViT-L/14
and ``TencentBAC/Conan-embedding-v1``) that CI cannot download. As with the embedded LLM
(:mod:`harness.models.tiny`), every feature must still run for real on the embedded default, so
``scoring.clip_model=tiny`` / ``scoring.embed_model=tiny`` select these stand-ins. **Their weights are random**
(``"weights": "random-init"`` in ``harness_model.json`` and in :meth:`harness.metrics.scoring.Scorer.describe`):
scores computed with them exercise the scoring path (image loading, preprocessing, tokenisation, pooling,
projection, the cosine → score maps, aggregation) and mean nothing. For paper-comparable numbers use
``scoring=reference`` (``clip_model=ViT-L-14 clip_pretrained=openai embed_model=TencentBAC/Conan-embedding-v1``;
the CLIP needs the ``[clip]`` extra); ``model=qwen3_vl_30b_a3b`` selects it.

* :func:`ensure_tiny_clip` — a transformers ``CLIPModel`` (ViT image tower 64 px / patch 16, 2-layer text
  tower of width 32, projection 32) saved with ``save_pretrained`` beside transformers' ``CLIPTokenizer`` (the
  reference's CLIP normalisation and byte-level pre-tokenisation, on a merge-free byte vocabulary: CLIP's own
  merges ship only with open_clip) and the OpenAI preprocessing for the PIL image processor, loaded with
  ``TransformersClipScorer(<dir>)``. Built and scored with the base install alone — no open_clip, no
  torchvision — so the default run needs no extra. Scoring the 59 images of the bundled RAG-IGBench sample
  takes well under a second on two CPU cores.
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
    projection_dim: int = 32
    image_size: int = 64
    patch_size: int = 16
    vision_width: int = 32
    vision_layers: int = 2
    vision_heads: int = 2
    text_width: int = 32
    text_heads: int = 2
    text_layers: int = 2
    context_length: int = 77  # CLIP's text positions (a 25-character Chinese context is 75 byte tokens + 2)
    format_version: int = 2  # 2: a transformers CLIPModel directory (1 was an open_clip one)

    def fingerprint(self) -> str:
        return _fingerprint(self)

    def clip_config(self, vocab_size: int, bos: int, eos: int) -> dict[str, Any]:
        """``transformers.CLIPConfig`` keyword arguments (eos != 2: pooling at the first end-of-text token)."""
        return {
            "projection_dim": self.projection_dim,
            "text_config": {"vocab_size": vocab_size, "hidden_size": self.text_width,
                            "intermediate_size": 2 * self.text_width, "num_hidden_layers": self.text_layers,
                            "num_attention_heads": self.text_heads, "max_position_embeddings": self.context_length,
                            "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": eos,
                            "projection_dim": self.projection_dim},
            "vision_config": {"hidden_size": self.vision_width, "intermediate_size": 2 * self.vision_width,
                              "num_hidden_layers": self.vision_layers, "num_attention_heads": self.vision_heads,
                              "image_size": self.image_size, "patch_size": self.patch_size,
                              "projection_dim": self.projection_dim},
        }


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


def build_clip_tokenizer():
    """transformers' ``CLIPTokenizer`` (the reference's CLIP normalisation: NFC, whitespace, lower case, CLIP's
    regex, byte-level with ``</w>`` word ends) on a merge-free vocabulary: the 256 byte symbols, each also with
    ``</w>``, then ``<|startoftext|>`` and ``<|endoftext|>``. Any text encodes; nothing is downloaded (CLIP's
    own 49k-entry vocabulary ships only with open_clip)."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    symbols = [*alphabet, *(a + "</w>" for a in alphabet), "<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={sym: i for i, sym in enumerate(symbols)}, merges=[],
                         model_max_length=TinyClipSpec().context_length)


def build_tiny_clip(out_dir: str | Path, spec: TinyClipSpec | None = None) -> Path:
    """Write the tiny CLIP as a transformers directory (``CLIPModel`` weights, ``CLIPTokenizer``, the OpenAI
    preprocessing at ``image_size`` for the PIL image processor, marker). Base install only (no open_clip)."""
    from transformers import CLIPConfig, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    spec = spec or TinyClipSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_clip_tokenizer()
    bos, eos = tokenizer.convert_tokens_to_ids(["<|startoftext|>", "<|endoftext|>"])
    model = CLIPModel(CLIPConfig(**spec.clip_config(len(tokenizer), bos, eos))).eval()
    seeded_init(model, spec.seed)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    CLIPImageProcessorPil(size={"shortest_edge": spec.image_size},
                          crop_size={"height": spec.image_size, "width": spec.image_size}).save_pretrained(out)
    (out / MARKER).write_text(json.dumps(
        {"name": "tiny-clip", "weights": "random-init", "fingerprint": spec.fingerprint(),
         "spec": dataclasses.asdict(spec),
         "note": "random weights: scores exercise the CLIP-score path and mean nothing"}, indent=2) + "\n")
    return out


def ensure_tiny_clip(cache_dir: str | Path | None = None, seed: int = 0, spec: TinyClipSpec | None = None) -> str:
    """Directory of the tiny CLIP (``TransformersClipScorer(path)`` loads it), building it on first use."""
    spec = spec or TinyClipSpec(seed=seed)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return str(build_once(root / clip_dir_name(spec), lambda tmp: build_tiny_clip(tmp, spec)))


# --------------------------------------------------------------------------------------- text embedder


def build_embedder_tokenizer(spec: TinyTextEmbedderSpec, corpus: list[str] | None = None, cjk_chars: bool = False):
    """A byte-level BPE tokenizer trained locally, BERT-style ``[CLS] … [SEP]`` framing, ``[PAD]`` right.

    ``corpus``: the lines the BPE merges are learnt from (default: the few lines above; the trained scorer of
    :mod:`harness.metrics.scorer_training` passes the synthetic generator's vocabulary). ``cjk_chars``: every
    Chinese character its own piece, as Chinese BERTs tokenise (merges never span two characters, so two
    phrases sharing a word share its tokens)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("[\u4e00-\u9fff]"), "isolated"),
                                                  byte_level]) if cjk_chars else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=spec.vocab_size, special_tokens=list(_EMBEDDER_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    lines = corpus if corpus is not None else _TOKENIZER_CORPUS.splitlines()
    tok.train_from_iterator([l for l in lines if l.strip()], trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
        unk_token=None, model_max_length=spec.max_position_embeddings, padding_side="right")


def build_tiny_text_embedder(out_dir: str | Path, spec: TinyTextEmbedderSpec | None = None,
                             corpus: list[str] | None = None, cjk_chars: bool = False) -> Path:
    """Write the tiny embedder: a transformers BERT checkpoint plus sentence-transformers module files
    (``corpus``, ``cjk_chars``: the tokenizer's, see :func:`build_embedder_tokenizer`)."""
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    spec = spec or TinyTextEmbedderSpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_embedder_tokenizer(spec, corpus, cjk_chars)
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
