"""The embedded default model: a tiny, seeded Qwen3-VL-MoE that both engines load.

Why a model of our own: CI has no GPU and no network, yet every feature (VisionZip on the vision tower,
SERE on the MoE router, HF = vLLM token for token) must run for real. A few-hundred-kilobyte
``Qwen3VLMoeForConditionalGeneration`` with the real architecture — MoE text layers with 16 experts and
top-4 (so SERE has secondary experts to re-route), a vision tower with spatial merge 2 and deepstack
layers — exercises every code path the real 30B checkpoint does, in seconds.

The checkpoint is written as a normal Hugging Face directory (``config.json``, ``model.safetensors``,
``tokenizer.json`` + chat template, ``preprocessor_config.json``) so ``from_pretrained(path)`` and
``vllm.LLM(path)`` both read it. Facts that shaped it (``shared/notes/environment.md``):

- experts are saved in the original Qwen checkpoint layout (``gate_up_proj [E, H, 2I]``,
  ``down_proj [E, I, H]``), which vLLM expects and transformers converts on load; ``hidden_size`` is
  deliberately not ``2 × moe_intermediate_size`` so a wrongly transposed load fails loudly;
- ``norm_topk_prob=True`` in the text config (vLLM reads it; HF's router always renormalises);
- text head_dim 32 (a size vLLM's CPU attention accepts) and ``mrope_section`` summing to head_dim/2;
- the image processor is the PIL one (no torchvision needed) with patch 16, merge 2, temporal patch 2.

Weights built here are random (``weights = "random-init"``, ``model=tiny_random``): numbers from them test
the machinery, never quality. The default ``model=tiny`` is this architecture *trained* on the project's
synthetic task suite (:mod:`harness.models.trained`, ``python -m harness.models.train_tiny``), written by
:func:`save_checkpoint` with the same conventions.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.config.paths import cache_home

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen-style chat template: each image is <|vision_start|><|image_pad|><|vision_end|>; the processor
# (HF) or the engine (vLLM) expands <|image_pad|> to the image's number of LLM tokens.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Text the tokenizer is trained on: the answer format of RAG-IGBench (JSON keys, markdown image tags,
# citations), Chinese and English prose, digits. The tokenizer only has to cover what prompts and
# answers contain; byte-level BPE guarantees it can encode anything.
_TOKENIZER_CORPUS = """\
{"reason": "用户询问的是问题，属于图文类别。", "category": "image-text", "answer": "回答 ![图](IMG#1) 文字<sup>[1](DOC#1)</sup>"}
用户问题 笔记 图片 回答 请根据以下笔记回答问题，并在合适的位置插入图片。以JSON格式输出，包含reason、category和answer三个字段。
The user asks a question. Answer using the notes and insert the images where they help. Output JSON with the keys reason, category and answer.
旅游 美食 穿搭 护肤 健身 数码 家居 理财 教育 宠物 摄影 咖啡 面包 火锅 蛋糕 城市 公园 海边 山 雪 花 猫 狗
Travel food fashion skincare fitness gadgets home finance education pets photography coffee bread hotpot cake city park beach mountain snow flower cat dog
what-is how-to yes-or-no head-to-head Finance Food Travel Beauty Tech Home Sports
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 100 2024 2025 ![ ]( ) IMG# DOC# <sup> </sup> [ ] { } " : , 。 ， ！ ？ 、 ；
"""


@dataclass(frozen=True)
class TinyModelSpec:
    """Every number that decides the embedded checkpoint; its hash names the cache directory."""

    seed: int = 0
    vocab_size: int = 1024
    hidden_size: int = 64
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 16
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 48
    mrope_section: tuple[int, int, int] = (6, 5, 5)
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 8192
    initializer_range: float = 0.5
    vision_depth: int = 4
    vision_hidden_size: int = 32
    vision_num_heads: int = 2
    vision_intermediate_size: int = 64
    deepstack_visual_indexes: tuple[int, ...] = (1, 2)
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    num_position_embeddings: int = 256
    min_pixels: int = 32 * 32
    max_pixels: int = 128 * 128
    format_version: int = 2  # bump when the writer changes the files it produces
    corpus: str = "base"  # "tasks": the tokenizer also learns the synthetic task suite's words (trained model)

    def fingerprint(self) -> str:
        """Short stable hash of the spec: the cache directory name and the model's identity in results."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def default_cache_dir() -> Path:
    """Where built models live: ``$HARNESS_CACHE/models`` (:func:`harness.config.paths.cache_home`)."""
    return cache_home() / "models"


MARKER = "harness_model.json"  # written last by every builder: its presence means the directory is complete


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """``target`` if complete (``MARKER`` present), else ``build`` it in a temporary sibling renamed into place.

    A killed build never leaves a half-written directory that later runs would trust, and two processes
    building at once keep whichever finished first. Shared by every locally built artefact (the tiny model,
    the tiny scorer encoders).
    """
    import fcntl
    import glob
    import os
    import time

    # Each build holds an flock on its temporary directory, which the kernel drops when the builder dies: a
    # ``<name>.<random>`` sibling that can be locked is what a killed build left (older than a minute, so a build
    # between mkdtemp and its flock is never taken for one) and is removed, also when the target is complete by
    # now (a glob of one directory per call). A live build's stays.
    stale_s = 60.0
    for stale in target.parent.glob(glob.escape(target.name) + ".*"):
        try:
            if not stale.is_dir() or time.time() - stale.stat().st_mtime < stale_s:
                continue
            fd = os.open(stale, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live build holds it (or this file system has no flock): leave it
            os.close(fd)
            continue
        shutil.rmtree(stale, ignore_errors=True)
        os.close(fd)
    if (target / MARKER).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    lock = os.open(tmp, os.O_RDONLY)
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # no flock here: the build still works, it is only not protected from clean-up
            pass
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first: keep theirs
            if not (target / MARKER).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
    return target


def ensure_tiny_model(spec: TinyModelSpec | None = None, cache_dir: str | Path | None = None) -> Path:
    """Return the directory of the embedded checkpoint, building it on first use (atomically)."""
    spec = spec or TinyModelSpec()
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    return build_once(root / f"tiny-qwen3-vl-moe-{spec.fingerprint()}", lambda tmp: build_tiny_model(tmp, spec))


def tokenizer_corpus(corpus: str = "base") -> list[str]:
    """Lines the tokenizer is trained on: the built-in corpus plus the benchmark prompt templates, so the
    long fixed instructions of RAG-IGBench prompts cost few tokens (CI runs them on two CPU cores); with
    ``corpus="tasks"`` also every word of the synthetic task suite (so answers are short token sequences)."""
    prompts = Path(__file__).resolve().parents[1] / "datasets" / "prompts"
    lines = _TOKENIZER_CORPUS.splitlines()
    for template in sorted(prompts.glob("*.jinja")):
        lines += template.read_text(encoding="utf-8").splitlines()
    if corpus == "tasks":
        from harness.datasets.synthetic.tasks import corpus_lines

        lines += corpus_lines()
    return [line for line in lines if line.strip()]


def build_tokenizer(spec: TinyModelSpec):
    """Train a byte-level BPE tokenizer locally (no download) with the Qwen-VL special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if spec.corpus == "tasks":
        # every CJK character (and full-width punctuation) its own pre-token: a word is the same tokens in the
        # prompt and in the answer, so the trained model copies notes and queries token by token
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex("[\u3000-\u303f\u4e00-\u9fff\uff00-\uffef]"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size - len(SPECIAL_TOKENS),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tokenizer_corpus(spec.corpus), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        model_max_length=spec.max_position_embeddings,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(spec: TinyModelSpec, tokenizer):
    """The ``Qwen3VLMoeConfig`` of the embedded model, token ids taken from the tokenizer."""
    from transformers import Qwen3VLMoeConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        num_experts=spec.num_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
        moe_intermediate_size=spec.moe_intermediate_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "mrope_section": list(spec.mrope_section),
            "mrope_interleaved": True,
        },
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=spec.vision_depth,
        hidden_size=spec.vision_hidden_size,
        num_heads=spec.vision_num_heads,
        intermediate_size=spec.vision_intermediate_size,
        patch_size=spec.patch_size,
        spatial_merge_size=spec.spatial_merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        out_hidden_size=spec.hidden_size,
        num_position_embeddings=spec.num_position_embeddings,
        deepstack_visual_indexes=list(spec.deepstack_visual_indexes),
        initializer_range=spec.initializer_range,
    )
    config = Qwen3VLMoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3VLMoeForConditionalGeneration"]
    config.dtype = "float32"
    return config


def build_processor(spec: TinyModelSpec, tokenizer):
    """A ``Qwen3VLProcessor`` around the PIL image processor (so torchvision is never required)."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    image_processor = Qwen2VLImageProcessorPil(
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.spatial_merge_size,
        min_pixels=spec.min_pixels,
        max_pixels=spec.max_pixels,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    video_processor = Qwen3VLVideoProcessor(
        patch_size=spec.patch_size,
        temporal_patch_size=spec.temporal_patch_size,
        merge_size=spec.spatial_merge_size,
    )
    return Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=CHAT_TEMPLATE,
    )


def init_weights(model, spec: TinyModelSpec) -> None:
    """Deterministic random weights: every floating tensor drawn from one seeded generator, by name.

    Drawing by sorted parameter name (instead of relying on module init order) keeps the weights a
    pure function of the seed across transformers versions. Norm weights stay 1 so activations stay
    in range; everything else is N(0, std) with std ~ 1/sqrt(fan_in) so that a random model still has
    peaked, input-dependent routing (uniform routing would make SERE trivial).
    """
    import torch

    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if "norm" in name and name.endswith("weight"):
                param.fill_(1.0)
                continue
            if name.endswith("bias"):
                param.zero_()
                continue
            fan_in = param.shape[-1] if param.dim() > 1 else param.numel()
            std = 1.0 / max(fan_in, 1) ** 0.5
            if name.endswith("embed_tokens.weight") or "pos_embed" in name:
                std = 1.0
            elif name.endswith("mlp.gate.weight"):
                std = 4.0 / max(fan_in, 1) ** 0.5  # sharper routing than uniform
            param.copy_(torch.randn(param.shape, generator=gen) * std)


def write_compatible_config(path: Path) -> None:
    """Spell renamed keys both ways so transformers 5.17 (GPU machine), < 5.20 (vLLM lane) and the newest
    all read the same values: newer versions write ``num_local_experts`` / ``rope_parameters``, older
    ones read ``num_experts`` / ``rope_scaling`` + ``rope_theta``."""
    cfg = json.loads(path.read_text())
    text = cfg["text_config"]
    if "num_local_experts" in text:
        text.setdefault("num_experts", text["num_local_experts"])
    if "num_experts" in text:
        text.setdefault("num_local_experts", text["num_experts"])
    if "rope_parameters" in text:
        text.setdefault("rope_scaling", dict(text["rope_parameters"]))
        text.setdefault("rope_theta", text["rope_parameters"].get("rope_theta"))
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_checkpoint(model, tokenizer, spec: TinyModelSpec, out_dir: str | Path, marker: dict) -> Path:
    """Write ``model`` as the harness's checkpoint directory: experts in the original Qwen layout, config keys
    spelt for every transformers version, tokenizer, processor, and ``MARKER`` (``marker`` + the spec) last."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            tensor = tensor.transpose(1, 2)  # HF [E, 2I, H] / [E, H, I] -> checkpoint [E, H, 2I] / [E, I, H]
        state[name] = tensor.detach().to("cpu").contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(out)
    write_compatible_config(out / "config.json")
    tokenizer.save_pretrained(out)
    build_processor(spec, tokenizer).save_pretrained(out)
    (out / MARKER).write_text(json.dumps({**marker, "fingerprint": spec.fingerprint(),
                                          "spec": dataclasses.asdict(spec)}, indent=2, ensure_ascii=False) + "\n")
    return out


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write the random-init embedded checkpoint to ``out_dir`` (config, safetensors, tokenizer, processor)."""
    import torch
    from transformers import Qwen3VLMoeForConditionalGeneration

    spec = spec or TinyModelSpec()
    tokenizer = build_tokenizer(spec)
    config = build_config(spec, tokenizer)
    torch.manual_seed(spec.seed)
    model = Qwen3VLMoeForConditionalGeneration(config).to(torch.float32).eval()
    init_weights(model, spec)
    return save_checkpoint(model, tokenizer, spec, out_dir, {"name": "tiny-qwen3-vl-moe", "weights": "random-init"})
