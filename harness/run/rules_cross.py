"""The core config groups' rules between keys (model, dataset, engine, generation, load, VisionZip, SERE, top-K,
scoring: the groups whose one-key rows are harness/run/validate.py's RULES). validate.py's CROSS_RULES are these
rows, then the feature blocks' (rules_offload.py, rules_latency.py).

Why a table of their own: what one key allows here depends on another, and mostly on what runs the config — the
engine (VisionZip, SERE and top-K run in the HF and vLLM engines only; vLLM's limits on VisionZip's scope and on
random routing under CUDA graphs), the kind of model (a real-shape model with random weights needs no
``model.path`` and runs a fixed synthetic load), the load mode (``load.*`` and sampling only where the vllm serve
client reads them) and the scorers (an open_clip model needs its extra; a real-weight model is not scored by
random-init scorers). The rows are checked in order and the first refusal is the one reported, so the order is
part of the behaviour: a row is added or moved with its neighbours' order in mind. Imports the registries and
tables of the layers below at module level, nothing heavy (no torch).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from harness.config.checks import _select, _sere_on, _vllm, _vz_on, CrossRule
from harness.metrics.scoring import clip_backend, Scorer
from harness.models.real_shapes import ARCHS  # the shapes archs (a table; torch and transformers stay unimported)
from harness.run.rules_model import _moe_top_k


def _clip_needs_open_clip(cfg: Any) -> bool:
    return bool(cfg.scoring.clip_model) and clip_backend(cfg.scoring.clip_model) == "open_clip"


def _random_scorers(cfg: Any) -> list[str]:
    d = Scorer(cfg.scoring).describe()
    # trained-synthetic scorers (the default) learnt the embedded data's images and notes only: on a real
    # model's answers they mean no more than random ones
    return [k for k in ("clip", "embed") if d[f"{k}_weights"] in ("random-init", "trained-synthetic")]


#: Engines that implement the techniques (VisionZip, SERE, plain top-K); any other registered engine (a user's,
#: a test's scripted one) would run them as stock, so they are refused there rather than silently ignored.
TECHNIQUE_ENGINES = ("hf", "vllm")


def _shapes(cfg: Any) -> bool:
    return _select(cfg, "model.shapes.arch", None) is not None


def _text_only_shapes(cfg: Any) -> bool:
    arch = _select(cfg, "model.shapes.arch", None)
    return arch in ARCHS and ARCHS[arch]["vision"] is None


def _technique_engine(cfg: Any) -> bool:
    return cfg.engine.name in TECHNIQUE_ENGINES


#: Rules between keys (what one engine or one model can do with another key's value).
CORE_CROSS_RULES: tuple[CrossRule, ...] = (
    CrossRule("visionzip.keep", _vz_on, _technique_engine,
              lambda cfg: f"1.0 with engine={cfg.engine.name} (VisionZip is implemented in {', '.join(TECHNIQUE_ENGINES)})"),
    CrossRule("sere.k", _sere_on, _technique_engine,
              lambda cfg: f"null with engine={cfg.engine.name} (SERE is implemented in {', '.join(TECHNIQUE_ENGINES)})"),
    CrossRule("moe.top_k", lambda cfg: _moe_top_k(cfg) is not None, _technique_engine,
              lambda cfg: f"null with engine={cfg.engine.name} (moe.top_k is implemented in "
              f"{', '.join(TECHNIQUE_ENGINES)})"),
    # SERE re-routes the experts ranked k+1..top-K of each token; with sere.k >= moe.top_k it has none, and the
    # run used to go on as plain top-K labelled "SERE" (moved_fraction=None): refused (issue 26)
    CrossRule("sere.k", lambda cfg: _sere_on(cfg) and _moe_top_k(cfg) is not None,
              lambda cfg: cfg.sere.k < _moe_top_k(cfg),
              lambda cfg: f"an integer below moe.top_k={_moe_top_k(cfg)} (SERE keeps k of the top-"
              f"{_moe_top_k(cfg)} experts and re-routes the rest; 0 or null = off, which leaves plain top-"
              f"{_moe_top_k(cfg)})"),
    # the baselines keep tokens without merging: contextual tokens are VisionZip's own (issue 31)
    CrossRule("visionzip.contextual", lambda cfg: _select(cfg, "visionzip.method", "attention") != "attention",
              lambda cfg: cfg.visionzip.contextual == 0,
              lambda cfg: f"0 with visionzip.method={cfg.visionzip.method} (only method=attention merges "
              "contextual tokens)"),
    CrossRule("moe.routing", lambda cfg: _vllm(cfg) and _select(cfg, "moe.routing", None) == "random_p",
              lambda cfg: bool(_select(cfg, "engine.enforce_eager", False)) or cfg.engine.device == "cpu",
              "top_p with engine=vllm and CUDA graphs (random_p draws on the device in its torch routing function, "
              "which a CUDA graph would replay with frozen draws: set engine.enforce_eager=true)"),
    CrossRule("moe.routing", lambda cfg: _select(cfg, "moe.routing", None) is not None, _technique_engine,
              lambda cfg: f"null with engine={cfg.engine.name} (moe.routing is implemented in "
              f"{', '.join(TECHNIQUE_ENGINES)})"),
    CrossRule("visionzip.method", lambda cfg: _vllm(cfg) and _vz_on(cfg)
              and _select(cfg, "visionzip.method", "attention") != "attention",
              lambda cfg: cfg.visionzip.scope == "request",
              "attention with engine=vllm visionzip.scope=image (the baselines ride on the request bundle: "
              "visionzip.scope=request)"),
    CrossRule("moe.routing", lambda cfg: _select(cfg, "moe.routing", None) is not None,
              lambda cfg: _moe_top_k(cfg) is None and not _sere_on(cfg),
              "null with moe.top_k or sere.k set (a routing baseline replaces the routing: run it alone)"),
    CrossRule("model.path", lambda cfg: not cfg.model.embedded and not _shapes(cfg), lambda cfg: bool(cfg.model.path),
              "a checkpoint directory or hub id (required unless model.embedded=true or model.shapes.arch is set)"),
    # --- real-shape models and synthetic load (issue 17) ---
    # engine=vllm: the text shapes model from a written config.json with vLLM's dummy weights; the VL one only
    # through vllm serve (load.endpoint=auto: written with the embedded tokenizer and processor, chat requests)
    CrossRule("model.shapes.arch", _shapes,
              lambda cfg: cfg.engine.name == "hf" or (_vllm(cfg) and (
                  _text_only_shapes(cfg) or cfg.load.get("endpoint") == "auto")),
              lambda cfg: ("a text-only arch with engine=vllm in process (the VL shapes model runs in vLLM through "
                           "load.qps=… load.endpoint=auto, or with engine=hf)") if _vllm(cfg) else
              "null with an engine other than hf or vllm (shapes models are built by the HF engine, or loaded by "
              "vLLM with dummy weights)"),
    CrossRule("load.endpoint", lambda cfg: _shapes(cfg) and _vllm(cfg) and cfg.load.get("endpoint") is not None,
              lambda cfg: cfg.load.get("endpoint") == "auto",
              "auto or null with model.shapes.arch (a running server serves its own model; auto starts `vllm serve` "
              "on the shapes model's config with dummy weights)"),
    CrossRule("model.weights", _shapes, lambda cfg: cfg.model.weights == "random-init",
              "random-init with model.shapes.arch set (its weights are random)"),
    CrossRule("engine.device_map", lambda cfg: _shapes(cfg) and _select(cfg, "engine.device_map", None) is not None,
              lambda cfg: False, "null with model.shapes.arch (a shapes model is built on engine.device)"),
    CrossRule("dataset.name", lambda cfg: cfg.dataset.name == "synthetic_load",
              lambda cfg: cfg.engine.name == "hf" or (_vllm(cfg) and _shapes(cfg)),
              "not synthetic_load with an engine other than hf, except engine=vllm with a shapes model (its "
              "token-id prompts need a tokenizer-free path)"),
    CrossRule("dataset.n_images", lambda cfg: cfg.dataset.name == "synthetic_load" and _text_only_shapes(cfg),
              lambda cfg: cfg.dataset.n_images == 0,
              lambda cfg: f"0 with a text-only model (model.shapes.arch={cfg.model.shapes.arch})"),
    CrossRule("generation.ignore_eos", lambda cfg: cfg.dataset.name == "synthetic_load",
              lambda cfg: bool(_select(cfg, "generation.ignore_eos", False)),
              "true with dataset=synthetic_load (add generation=synthetic_load: a fixed output length)"),
    CrossRule("generation.max_new_tokens", lambda cfg: cfg.dataset.name == "synthetic_load",
              lambda cfg: cfg.generation.max_new_tokens == cfg.dataset.output_tokens,
              lambda cfg: f"dataset.output_tokens={cfg.dataset.output_tokens} with dataset=synthetic_load (add "
              "generation=synthetic_load, or set dataset.output_tokens instead)"),
    CrossRule("load.qps", lambda cfg: cfg.load.qps is not None, _vllm,
              "null with engine=hf (load mode needs engine=vllm)"),
    CrossRule("load.endpoint", lambda cfg: cfg.load.get("endpoint") is not None,
              lambda cfg: _vllm(cfg) and cfg.load.qps is not None,
              "null unless engine=vllm and load.qps is set (the vllm serve mode is a load test)"),
    # the data URLs the vllm serve client writes; every other path hands the engine PIL images
    CrossRule("load.image_format", lambda cfg: _select(cfg, "load.image_format", "png") != "png",
              lambda cfg: _vllm(cfg) and cfg.load.get("endpoint") is not None,
              "png unless engine=vllm with load.endpoint set (only the vllm serve client encodes images; every "
              "other path hands the engine the decoded pixels)"),
    # only the vllm serve load client samples (temperature 1, a seed per request: a random-weight load test needs
    # it, docs/vllm.md); the engines' own generate paths decode greedily, so anywhere else the key would do nothing
    CrossRule("generation.do_sample", lambda cfg: bool(_select(cfg, "generation.do_sample", False)),
              lambda cfg: _vllm(cfg) and cfg.load.get("endpoint") is not None,
              "false unless engine=vllm with load.endpoint set (the vllm serve load client samples with "
              "temperature 1 and a seed per request; every other path decodes greedily)"),
    # --- VisionZip in vLLM (branch vllm-budget): scope=request (the bundle) is available; the per-image
    # fixed ratio keeps its two limits
    CrossRule("visionzip.contextual", lambda cfg: _vllm(cfg) and _vz_on(cfg) and cfg.visionzip.scope == "image",
              lambda cfg: cfg.visionzip.contextual == 0,
              "0 with engine=vllm visionzip.scope=image (contextual tokens need scope=request: docs/vllm.md)"),
    CrossRule("visionzip.min_per_image", lambda cfg: _vllm(cfg) and _vz_on(cfg) and cfg.visionzip.scope == "image",
              lambda cfg: cfg.visionzip.min_per_image >= 1,
              ">= 1 with engine=vllm visionzip.scope=image (an image of 0 tokens breaks vLLM's placeholder "
              "validation; scope=request has one placeholder for all images)"),
    CrossRule("scoring.clip_model", _clip_needs_open_clip, lambda cfg: importlib.util.find_spec("open_clip") is not None,
              "tiny, transformers:<repo or dir> or null (no CLIP score) without the [clip] extra (an open_clip "
              "model needs pip install 'moe-vlm-harness[clip]')"),
    CrossRule("scoring.allow_random_scorers", lambda cfg: cfg.model.weights == "real",
              lambda cfg: bool(cfg.scoring.get("allow_random_scorers", False)) or not _random_scorers(cfg),
              lambda cfg: "true to score a real-weight model with random-init scorers ("
              + ", ".join(f"scoring.{k}_model={cfg.scoring[f'{k}_model']!r}" for k in _random_scorers(cfg))
              + " has random weights or was trained on the synthetic data only); scoring=reference selects the "
              "reference's scorers"),
)
