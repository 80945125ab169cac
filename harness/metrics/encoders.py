"""The two neural encoders behind RAG-IGBench's image-text metrics, loaded lazily and cached.

* :class:`ClipScorer` — cosine(image, text) from an open_clip model (the ``[clip]`` extra). The default,
  ``('ViT-L-14', 'openai')``, is OpenAI's CLIP ViT-L/14, the same weights as ``openai/clip-vit-large-patch14``
  that the reference scorer (zry13/RAG-IGBench ``score/eval.py``) loads through transformers; open_clip's
  preprocessing for the ``openai`` tag (resize shortest side to 224 bicubic, centre crop, CLIP mean/std)
  matches the HF processor. OpenAI's weights were trained with QuickGELU, which open_clip 3's plain
  ``ViT-L-14`` config lacks (it only warns); the activation the pretrained tag declares is therefore forced.
  A local OpenAI checkpoint file needs the ``ViT-L-14-quickgelu`` config name for the same reason.
  **Tokenisation as the reference's**: open_clip's own tokenizer runs ``ftfy.fix_text`` and ``html.unescape``
  first, which turn full-width Chinese punctuation into ASCII (``，`` → ``,``, ``！`` → ``!``, ``：`` → ``:``)
  and so change the tokens of nearly every RAG-IGBench context. The reference's ``CLIPProcessor`` uses
  transformers' ``CLIPTokenizer`` (the fast, ``tokenizers``-backed one): NFC, runs of whitespace → one space,
  lower case, CLIP's pre-tokenisation regex, byte-level BPE — no ftfy. For models whose open_clip tokenizer
  is CLIP's BPE (``SimpleTokenizer``: every OpenAI/LAION CLIP), :func:`reference_clip_tokenizer` builds exactly
  that transformers tokenizer from open_clip's own vocabulary and merges (nothing downloaded) and
  :class:`ClipScorer` tokenises with it; other tokenizers (multilingual models) are open_clip's.
  One difference on purpose: texts are truncated to the 77-token context (the last token kept as end of
  text, as open_clip does), where the reference's HF processor (``padding=True``, no truncation) raises for
  longer texts and the sample silently disappears.
* :class:`TransformersClipScorer` — the same cosine from a transformers ``CLIPModel`` directory or hub id
  (``scoring.clip_model=transformers:openai/clip-vit-large-patch14`` is the reference's own stack), with the
  PIL image processor (no torchvision) and the checkpoint's tokenizer. Base install only: the embedded
  ``tiny`` CLIP of :mod:`harness.metrics.tiny_encoders` is such a directory, and so is the trained CLIP of
  ``scoring=default`` (:mod:`harness.metrics.scorer_checkpoints`), so the default run needs no open_clip.
* :class:`TextEmbedder` — sentence embeddings from a transformers checkpoint (default
  ``TencentBAC/Conan-embedding-v1``). The reference calls ``SentenceTransformer(path).encode``, which runs the
  checkpoint's own module pipeline (``modules.json``: Transformer → Pooling → Dense → Normalize). We read that
  pipeline from the checkpoint instead of depending on sentence-transformers: the pooling mode comes from
  ``1_Pooling/config.json`` and the ``Dense`` projection (Conan: 1024 → 1792, with bias, which changes cosines)
  is applied when present. A checkpoint without ``modules.json`` gets mean pooling, which is also what
  SentenceTransformer falls back to for a plain transformers model.

Both take a hub name or a local path, load on first use (never at import or construction), and
:func:`get_clip_scorer` / :func:`get_text_embedder` keep one instance per configuration. A local directory whose
``harness_model.json`` records the SHA-256 of its weight files (the committed trained scorers) is checked
against them before it loads (:func:`harness.metrics.scorer_checkpoints.verify_checkpoint`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import functools
import json
import os
import threading
from collections.abc import Sequence
from typing import Any

from harness.metrics.scorer_checkpoints import verify_checkpoint

DEFAULT_CLIP_MODEL = "ViT-L-14"
DEFAULT_CLIP_PRETRAINED = "openai"
DEFAULT_EMBED_MODEL = "TencentBAC/Conan-embedding-v1"


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_image(image: Any):
    """A PIL image in RGB from a PIL image or a path; raises FileNotFoundError for a missing file."""
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        with Image.open(image) as im:
            return im.convert("RGB")
    raise TypeError(f"an image must be a PIL image or a path, not {type(image).__name__}")


class _PairScorer(ABC):
    """What both CLIP scorers share: a model built once on first use (thread-safe), and cosines of
    image/text pairs computed in batches. A subclass says how to build (``_build``) and how to encode one
    batch (``_encode``: image and text features, row for row)."""

    batch_size: int
    device: str | None

    def __init__(self, device: str | None, batch_size: int):
        self.device, self.batch_size = device, batch_size
        self._loaded: tuple[Any, Any, Any] | None = None
        self._lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._loaded is None:
                self.device = self.device or _default_device()
                self._loaded = self._build()
        return self._loaded

    @abstractmethod
    def _build(self) -> tuple[Any, Any, Any]:
        """The loaded model and what encodes its inputs (called once, under the lock)."""

    @abstractmethod
    def _encode(self, loaded: tuple[Any, Any, Any], images: list[Any], texts: list[str]):
        """Image and text features of one batch (PIL images, strings), row for row."""

    def cosines(self, images: Sequence[Any], texts: Sequence[str]) -> list[float]:
        """cos(image_i, text_i) for each pair (images: PIL images or paths)."""
        if len(images) != len(texts):
            raise ValueError(f"{len(images)} images but {len(texts)} texts")
        if not images:
            return []
        import torch

        loaded = self._load()
        out: list[float] = []
        for i in range(0, len(images), self.batch_size):
            batch = [_load_image(im) for im in images[i : i + self.batch_size]]
            with torch.no_grad():
                img, txt = self._encode(loaded, batch, [str(t) for t in texts[i : i + self.batch_size]])
            out.extend(torch.nn.functional.cosine_similarity(img.float(), txt.float(), dim=-1).tolist())
        return out


class ClipScorer(_PairScorer):
    """Cosine similarity of images and texts under an open_clip model.

    ``model_name``/``pretrained`` are open_clip's: a tag (``'openai'``), a local checkpoint file, or
    ``model_name='hf-hub:org/repo'`` with ``pretrained=None``. The model is built on the first call.
    """

    def __init__(
        self,
        model_name: str = DEFAULT_CLIP_MODEL,
        pretrained: str | None = DEFAULT_CLIP_PRETRAINED,
        device: str | None = None,
        *,
        cache_dir: str | None = None,
        batch_size: int = 16,
    ):
        super().__init__(device, batch_size)
        self.model_name, self.pretrained, self.cache_dir = model_name, pretrained, cache_dir

    def _build(self):
        import open_clip

        tag = open_clip.get_pretrained_cfg(self.model_name, self.pretrained) if self.pretrained else {}
        model, _, preprocess = open_clip.create_model_and_transforms(
            self.model_name, pretrained=self.pretrained, device=self.device, cache_dir=self.cache_dir,
            force_quick_gelu=bool(tag.get("quick_gelu", False)),
        )
        model.eval()
        tokenizer = open_clip.get_tokenizer(self.model_name)
        if isinstance(tokenizer, open_clip.tokenizer.SimpleTokenizer):  # CLIP's BPE: tokenise as HF does
            tokenizer = reference_clip_tokenizer(tokenizer)
        return model, preprocess, tokenizer

    def _encode(self, loaded, images, texts):
        import torch

        model, preprocess, tokenizer = loaded
        ims = torch.stack([preprocess(im) for im in images])
        return model.encode_image(ims.to(self.device)), model.encode_text(tokenizer(texts).to(self.device))

    def __repr__(self) -> str:
        return f"ClipScorer({self.model_name!r}, {self.pretrained!r}, device={self.device!r})"


class _ReferenceClipTokenizer:
    """transformers' ``CLIPTokenizer`` on open_clip's vocabulary, called like an open_clip tokenizer: a
    ``[B, context_length]`` LongTensor, zero-padded (open_clip's CLIP pools the text at the highest id, the end
    of text, so padding after it changes nothing), truncated with the end-of-text token kept last."""

    def __init__(self, hf_tokenizer: Any, context_length: int, eot_id: int):
        self.hf, self.context_length, self.eot_id = hf_tokenizer, context_length, eot_id

    def __call__(self, texts: Sequence[str]):
        import torch

        ids = self.hf([str(t) for t in texts], add_special_tokens=True)["input_ids"]
        out = torch.zeros(len(ids), self.context_length, dtype=torch.long)
        for i, row in enumerate(ids):
            if len(row) > self.context_length:
                row = [*row[: self.context_length - 1], self.eot_id]
            out[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        return out


def reference_clip_tokenizer(simple_tokenizer: Any) -> _ReferenceClipTokenizer:
    """The reference scorer's CLIP tokenisation (transformers ``CLIPTokenizer``: no ftfy, no HTML unescaping)
    on the vocabulary and merges of an open_clip ``SimpleTokenizer`` (the same files as OpenAI's)."""
    from transformers import CLIPTokenizer

    ranks = simple_tokenizer.bpe_ranks
    merges = sorted(ranks, key=ranks.get)
    vocab = dict(simple_tokenizer.encoder)
    bos, eos = (simple_tokenizer.decoder[i] for i in (simple_tokenizer.sot_token_id, simple_tokenizer.eot_token_id))
    # open_clip names them <start_of_text> / <end_of_text>; OpenAI's and HF's files <|startoftext|> / <|endoftext|>:
    # the same ids (49406 / 49407), so the same token sequences
    hf = CLIPTokenizer(vocab=vocab, merges=[tuple(m) for m in merges], bos_token=bos, eos_token=eos, unk_token=eos,
                       pad_token=eos)
    return _ReferenceClipTokenizer(hf, int(simple_tokenizer.context_length), int(simple_tokenizer.eot_token_id))


class TransformersClipScorer(_PairScorer):
    """Cosine similarity of images and texts under a transformers ``CLIPModel`` (a directory or hub id).

    The reference's stack (``CLIPModel`` + ``CLIPProcessor``): the checkpoint's own tokenizer (for CLIP,
    transformers' ``CLIPTokenizer``, padded to the longest text, truncated at the model's positions) and its
    preprocessing read by the PIL image processor, so torchvision is never needed. Loaded on first use.
    """

    def __init__(self, name_or_path: str, device: str | None = None, *, batch_size: int = 16):
        super().__init__(device, batch_size)
        self.name_or_path = name_or_path

    def _build(self):
        from transformers import AutoTokenizer, CLIPModel
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

        verify_checkpoint(self.name_or_path)  # a committed trained scorer: its weights' SHA-256 first
        model = CLIPModel.from_pretrained(self.name_or_path).to(self.device).eval()
        return (model, CLIPImageProcessorPil.from_pretrained(self.name_or_path),
                AutoTokenizer.from_pretrained(self.name_or_path))

    def _encode(self, loaded, images, texts):
        model, processor, tokenizer = loaded
        limit = int(model.config.text_config.max_position_embeddings)
        pixels = processor(images=images, return_tensors="pt")["pixel_values"]
        toks = tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
        img = _features(model.get_image_features(pixel_values=pixels.to(self.device)))
        txt = _features(model.get_text_features(input_ids=toks["input_ids"].to(self.device),
                                                attention_mask=toks["attention_mask"].to(self.device)))
        return img, txt

    def __repr__(self) -> str:
        return f"TransformersClipScorer({self.name_or_path!r}, device={self.device!r})"


def _features(out: Any):
    """Projected features: transformers 5 returns a ``BaseModelOutputWithPooling`` (``pooler_output``)."""
    return out.pooler_output if hasattr(out, "pooler_output") else out


def _resolve(name_or_path: str, relpath: str) -> str | None:
    """Local path of a file of a checkpoint directory or hub repository, or None when it has none."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, relpath)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import hf_hub_download

        return hf_hub_download(repo_id=name_or_path, filename=relpath)
    except Exception:  # absent file, offline, unknown repository: treated alike as "not there"
        return None


_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# torch.nn class name in a Dense config → torch.nn.functional name (None: identity)
_ACTIVATIONS = {"Identity": None, "Tanh": "tanh", "ReLU": "relu", "Sigmoid": "sigmoid", "GELU": "gelu"}


def _pool(mode: str, hidden, mask):
    import torch

    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        return hidden[:, 0]
    if mode in ("mean", "mean_sqrt_len"):
        summed, n = (hidden * m).sum(1), m.sum(1).clamp(min=1e-9)
        return summed / (n if mode == "mean" else n.sqrt())
    if mode == "max":
        return hidden.masked_fill(m == 0, torch.finfo(hidden.dtype).min).max(1).values
    if mode == "lasttoken":
        last = mask.sum(1).clamp(min=1) - 1  # right padding assumed, as the tokenizers here pad right
        return hidden[torch.arange(hidden.shape[0]), last]
    if mode == "weightedmean":
        w = torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype)[None, :, None] * m
        return (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)
    raise ValueError(f"unknown pooling mode {mode!r}")


class TextEmbedder:
    """Sentence embeddings from a transformers checkpoint following its sentence-transformers modules.

    ``pooling`` ('cls', 'mean', …) overrides what the checkpoint declares. Loaded on first :meth:`encode`.
    """

    def __init__(
        self,
        name_or_path: str = DEFAULT_EMBED_MODEL,
        device: str | None = None,
        *,
        pooling: str | None = None,
        max_length: int | None = None,
        batch_size: int = 32,
    ):
        self.name_or_path, self.device, self.pooling = name_or_path, device, pooling
        self.max_length, self.batch_size = max_length, batch_size
        self._loaded: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _read_pipeline(self) -> tuple[list[str], Any, bool, int | None]:
        """(pooling modes, Dense layer or None, normalize, max_seq_length) declared by the checkpoint."""
        modes, dense, normalize, max_len = ["mean"], None, False, None
        bert_cfg = _resolve(self.name_or_path, "sentence_bert_config.json")
        if bert_cfg:
            with open(bert_cfg) as f:
                max_len = json.load(f).get("max_seq_length")
        modules_path = _resolve(self.name_or_path, "modules.json")
        if not modules_path:
            return modes, dense, normalize, max_len
        with open(modules_path) as f:
            modules = sorted(json.load(f), key=lambda m: int(m.get("idx", 0)))
        for mod in modules:
            kind, sub = mod.get("type", "").rsplit(".", 1)[-1], mod.get("path", "")
            if kind == "Pooling":
                cfg_path = _resolve(self.name_or_path, f"{sub}/config.json")
                if cfg_path:
                    with open(cfg_path) as f:
                        cfg = json.load(f)
                    modes = [v for k, v in _POOLING_KEYS.items() if cfg.get(k)] or ["mean"]
            elif kind == "Dense":
                dense = self._load_dense(sub)
            elif kind == "Normalize":
                normalize = True
        return modes, dense, normalize, max_len

    def _load_dense(self, sub: str):
        import torch

        with open(_resolve(self.name_or_path, f"{sub}/config.json")) as f:
            cfg = json.load(f)
        st_path = _resolve(self.name_or_path, f"{sub}/model.safetensors")
        if st_path:
            from safetensors.torch import load_file

            state = load_file(st_path)
        else:
            bin_path = _resolve(self.name_or_path, f"{sub}/pytorch_model.bin")
            if not bin_path:
                raise FileNotFoundError(f"{self.name_or_path}: Dense module {sub!r} has no weights")
            state = torch.load(bin_path, map_location="cpu", weights_only=True)
        layer = torch.nn.Linear(cfg["in_features"], cfg["out_features"], bias=cfg.get("bias", True))
        layer.load_state_dict({k.removeprefix("linear."): v for k, v in state.items()})
        act_name = str(cfg.get("activation_function", "Identity")).rsplit(".", 1)[-1]
        if act_name not in _ACTIVATIONS:
            raise NotImplementedError(f"Dense activation {act_name!r} is not supported")
        return layer, _ACTIVATIONS[act_name]

    def _load(self) -> dict[str, Any]:
        with self._lock:
            if self._loaded is None:
                from transformers import AutoModel, AutoTokenizer

                verify_checkpoint(self.name_or_path)  # a committed trained scorer: its weights' SHA-256 first
                self.device = self.device or _default_device()
                modes, dense, normalize, max_len = self._read_pipeline()
                model = AutoModel.from_pretrained(self.name_or_path).to(self.device).eval()
                tokenizer = AutoTokenizer.from_pretrained(self.name_or_path)
                limit = self.max_length or max_len or min(tokenizer.model_max_length, 512)
                if dense is not None:
                    dense = (dense[0].to(self.device).eval(), dense[1])
                self._loaded = dict(model=model, tokenizer=tokenizer, modes=[self.pooling] if self.pooling
                                    else modes, dense=dense, normalize=normalize, max_length=limit)
        return self._loaded

    def encode(self, texts: Sequence[str]):
        """Embeddings, a float32 tensor of shape [len(texts), dim] on the CPU."""
        import torch

        parts = self._load()
        if not texts:
            return torch.zeros(0, 0)
        chunks = []
        for i in range(0, len(texts), self.batch_size):
            batch = parts["tokenizer"]([str(t) for t in texts[i : i + self.batch_size]], padding=True,
                                       truncation=True, max_length=parts["max_length"], return_tensors="pt")
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with torch.no_grad():
                hidden = parts["model"](**batch).last_hidden_state
                emb = torch.cat([_pool(m, hidden, batch["attention_mask"]) for m in parts["modes"]], dim=-1)
                if parts["dense"] is not None:
                    layer, act = parts["dense"]
                    emb = layer(emb)
                    if act is not None:
                        emb = getattr(torch.nn.functional, act)(emb)
                if parts["normalize"]:
                    emb = torch.nn.functional.normalize(emb, dim=-1)
            chunks.append(emb.float().cpu())
        return torch.cat(chunks)

    def __call__(self, texts: Sequence[str]):
        return self.encode(texts)

    def __repr__(self) -> str:
        return f"TextEmbedder({self.name_or_path!r}, device={self.device!r})"


@functools.lru_cache(maxsize=4)
def get_clip_scorer(model_name: str = DEFAULT_CLIP_MODEL, pretrained: str | None = DEFAULT_CLIP_PRETRAINED,
                    device: str | None = None) -> ClipScorer:
    """One shared :class:`ClipScorer` per configuration (still loaded only on first use)."""
    return ClipScorer(model_name, pretrained, device)


@functools.lru_cache(maxsize=4)
def get_text_embedder(name_or_path: str = DEFAULT_EMBED_MODEL, device: str | None = None) -> TextEmbedder:
    """One shared :class:`TextEmbedder` per configuration (still loaded only on first use)."""
    return TextEmbedder(name_or_path, device)
