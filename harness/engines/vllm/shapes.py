"""Real-shape models in ``engine=vllm``: a ``config.json`` and vLLM's dummy weights, token-id prompts.

``model=<arch>_shapes engine=vllm`` (every text-only arch of :data:`harness.models.real_shapes.ARCHS`: Qwen3-30B-A3B,
Mixtral-8x7B, DeepSeek-V2-Lite, OLMoE-1B-7B, GPT-OSS-20B, Qwen2-57B-A14B; ``_4l`` / ``_tiny`` presets) loads no
checkpoint: the engine writes the
shapes ``config.json`` (:func:`harness.models.real_shapes.shapes_config`, the same dict the HF engine builds its
model from) into a run-local directory and starts ``LLM(model=that_dir, load_format="dummy",
skip_tokenizer_init=True)``: vLLM fills every weight with its own dummy initialiser (uniform in ±1e-3, fixed seed),
no tokenizer and no processor are read. Prompts go to vLLM as token ids, built exactly as the HF engine's
tokenizer-free path builds them (:mod:`harness.engines.hf.direct`): ``synthetic_tokens`` parts → the same seeded
ids (:func:`harness.models.real_shapes.synthetic_ids`), text parts → the byte-level
:class:`~harness.models.real_shapes.ShapesTokenizer`; no chat template. Output ids
are decoded with the same tokenizer (the answer text is the ids).

In process only the text model: the Qwen3-VL shapes model needs a multimodal processor inside vLLM (placeholder
expansion, image patches), which a tokenizer-free config directory does not give; it is refused with that reason.
Served (``load.endpoint=auto``) it runs: the directory then also holds a tokenizer and a processor
(:mod:`harness.engines.vllm.served_shapes`), requests go through the chat API with their images, and a
``synthetic_tokens`` part becomes that many single-token words (:meth:`VllmShapes.chat_text`).

Weights: random, and *not* the HF engine's random weights (vLLM's dummy loader, not ``normal_(0, 0.02)``); routing
of random weights is near-uniform, unlike a trained model. ``summary.json`` says ``weights: random-init``.
No vLLM import here: the pure parts are tested in the main venv.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from harness.engines.vllm.served_shapes import TOKENIZER_NOTE, one_token_words, words_of_length, write_served_model
from harness.models.real_shapes import (ARCHS, ShapesProcessor, ShapesTokenizer, config_special_ids, shapes_config,
                                       synthetic_ids, text_parameters)

#: where in a run directory the config of the model vLLM loads is written (kept: it is what ran)
CONFIG_DIR_NAME = "vllm_shapes_model"

#: recorded in ``describe()["shapes"]["init"]``
DUMMY_INIT = "vLLM load_format=dummy (uniform in [-1e-3, 1e-3], vLLM's fixed seed)"


def _plain(d: Any) -> dict[str, Any]:
    return {str(k): v for k, v in dict(d or {}).items()}


def config_from_cfg(shapes_cfg: Any) -> dict[str, Any]:
    """The ``config.json`` dict of ``model.shapes`` (what ``shapes_model_for_engine`` builds in HF)."""
    get = (lambda k: shapes_cfg.get(k)) if isinstance(shapes_cfg, dict) else (lambda k: getattr(shapes_cfg, k, None))
    return shapes_config(get("arch"), get("num_layers"), _plain(get("text")), _plain(get("vision")))


def write_config_dir(config: dict[str, Any], directory: str | Path) -> Path:
    """Write ``config.json`` (and nothing else: no weights, no tokenizer) into ``directory``; returns it. The
    dtype vLLM uses is the engine's (``engine.dtype``, always passed explicitly)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(directory / "config.json")
    return directory


def model_config_view(config: dict[str, Any]) -> SimpleNamespace:
    """An attribute view of a text ``config.json`` dict, for :func:`harness.models.real_shapes.synthetic_ids`
    (which reads ``vocab_size`` and the special ids as a transformers config has them)."""
    return SimpleNamespace(**config)


def prompt_token_ids(request: Any, config: dict[str, Any], tokenizer: ShapesTokenizer) -> list[int]:
    """The prompt ids of one request, as the HF engine's tokenizer-free path builds them (module doc)."""
    view = model_config_view(config)
    ids: list[int] = []
    for part in request.content:
        kind = part.get("type")
        if kind == "synthetic_tokens":
            ids += synthetic_ids(part["n"], part.get("seed", 0), view)
        elif kind == "text":
            ids += list(tokenizer(part["text"], add_special_tokens=False)["input_ids"])
        elif kind == "image":
            raise ValueError(f"request {request.uid}: an image part for the text-only shapes model "
                             f"(engine=vllm runs the text-only shapes models)")
        else:
            raise ValueError(f"request {request.uid}: unknown content part type {kind!r}")
    if not ids:
        raise ValueError(f"request {request.uid}: empty prompt")
    return ids


@dataclass
class VllmShapes:
    """The shapes model of one vLLM engine: its config, where it was written, its tokenizer. ``served``: the VL
    model in a directory with a tokenizer and a processor (:mod:`harness.engines.vllm.served_shapes`)."""

    arch: str
    config: dict[str, Any]
    directory: Path
    temporary: bool
    served: bool = False
    tokenizer: Any = field(init=False)
    processor: Any = field(init=False)
    _words: list[str] | None = field(init=False, default=None)  # chat_text's single-token words, found once

    def __post_init__(self) -> None:
        if self.served:  # the written tokenizer + Qwen3-VL processor, read back as any checkpoint's
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(str(self.directory))
        else:
            self.processor = ShapesProcessor(int(self.config["vocab_size"]), config_special_ids(self.config))
        self.tokenizer = self.processor.tokenizer

    @property
    def _text(self) -> dict[str, Any]:
        return self.config.get("text_config", self.config)

    @property
    def multimodal(self) -> bool:
        return "vision_config" in self.config

    def engine_args(self) -> dict[str, Any]:
        """What ``LLM(...)`` / ``AsyncEngineArgs`` / ``vllm serve`` get on top of the engine's usual arguments."""
        if self.served:
            return {"model": str(self.directory), "load_format": "dummy"}
        return {"model": str(self.directory), "load_format": "dummy", "skip_tokenizer_init": True}

    def chat_text(self, part: dict[str, Any]) -> str:
        """A ``synthetic_tokens`` part of a served request as text of exactly ``n`` tokens (seeded by the part)."""
        if self._words is None:
            self._words = one_token_words(self.tokenizer)
        return words_of_length(self.tokenizer, self._words, int(part["n"]), int(part.get("seed", 0)))

    def prompt(self, request: Any) -> dict[str, Any]:
        return {"prompt_token_ids": prompt_token_ids(request, self.config, self.tokenizer)}

    def describe(self) -> dict[str, Any]:
        """``run.engine_settings.shapes`` (the HF engine's fields where they apply)."""
        spec = ARCHS[self.arch]
        return {"arch": self.arch, "checkpoint_shapes_of": spec["checkpoint"], "family": spec["family"],
                **({"note": spec["note"]} if spec.get("note") else {}),
                "num_layers": self._text["num_hidden_layers"], "hidden_size": self._text["hidden_size"],
                "parameters": text_parameters(self.config), "weights": "random-init", "init": DUMMY_INIT,
                "load_format": "dummy", "tokenizer": TOKENIZER_NOTE if self.served else
                "ShapesTokenizer (byte-level; skip_tokenizer_init)",
                **({"served": "vllm serve, chat API (images as data URLs; synthetic tokens as single-token words)"}
                   if self.served else {})}

    def cleanup(self) -> None:
        if self.temporary:
            shutil.rmtree(self.directory, ignore_errors=True)


def hydra_run_dir() -> str | None:
    """The current Hydra run's output directory, when this process is inside one."""
    try:
        from hydra.core.hydra_config import HydraConfig

        return str(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - not a Hydra run (tests, scripts)
        return None


def shapes_for_vllm(shapes_cfg: Any, run_dir: str | None = None, serve: bool = False) -> VllmShapes:
    """Write the config of ``model.shapes`` where vLLM will load it: ``<run dir>/vllm_shapes_model`` (the given
    run directory, else the Hydra run's), else a temporary directory removed when the engine closes. ``serve``
    (``load.endpoint=auto``): the VL model is written with a tokenizer and a processor for the chat API; the text
    model stays a bare config (token-id prompts to the completions API)."""
    config = config_from_cfg(shapes_cfg)
    arch = str(shapes_cfg.get("arch") if isinstance(shapes_cfg, dict) else shapes_cfg.arch)
    vl = "text_config" in config
    if vl and not serve:
        raise NotImplementedError(
            f"model.shapes.arch={arch} with engine=vllm in process: the VL shapes model needs a multimodal processor "
            "inside vLLM, which a tokenizer-free config directory does not give; load.endpoint=auto serves it (with "
            "the embedded tokenizer and processor), engine=hf runs it in process (docs/vllm.md)")
    base = run_dir or hydra_run_dir()
    if base:
        directory, temporary = Path(base) / CONFIG_DIR_NAME, False
    else:
        directory, temporary = Path(tempfile.mkdtemp(prefix="harness-vllm-shapes-")), True
    if vl:
        config = write_served_model(config, directory)
        return VllmShapes(arch=arch, config=config, directory=directory, temporary=temporary, served=True)
    write_config_dir(config, directory)
    return VllmShapes(arch=arch, config=config, directory=directory, temporary=temporary)
