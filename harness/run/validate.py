"""Every config value checked before any model loads: one table of rules, one line per refusal, exit code 2.

Why a table: the issue that introduced this module found 20 of 52 config values silently accepted
(``visionzip.keep=1.5`` ran as a baseline, ``sere.k=100`` as a "SERE" run that moved nothing,
``engine.batch_size=0`` was recorded as 0 while batches of 1 ran, ``+sere.kk=2`` ran with SERE off) and 6
that ran to the end with every sample an error. Hydra's dataclass schemas check types only; ranges,
enumerations and cross-key rules live here as data, so what is allowed is readable in one place (and printed
in the refusal). Three passes, each raising :class:`ConfigError` with one line naming the key, the value and
what is allowed:

1. :func:`check_keys` — every key of the composed config exists in the schema (``+sere.kk=2`` and
   ``+unknown.key=1`` are force-added by Hydra's ``+`` even in struct mode, so they are refused here);
2. :func:`validate_config` — :data:`RULES` (one key each) then :data:`CROSS_RULES` (keys that depend on each
   other), plus :data:`NORMALIZE` (``sere.k=0`` is SERE off, the reference's identity: recorded as null);
3. :func:`validate_model` — :data:`MODEL_RULES`: values the checkpoint decides (vision depth, number of
   experts, experts per token), checked right after the checkpoint's ``config.json`` is read, before weights load.

A rule whose key does not exist in the config is inert (``moe.top_k`` is checked once a ``moe`` group exists).
The vocabulary (checks, rules, the refusal) is in validate_checks.py; the offload and latency groups' rows in
validate_offload.py and validate_latency.py, appended to the tables here.
Only the standard library and omegaconf are imported at module level.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.datasets import LOADERS, register_from_config  # light registries (names → "module:attr"), nothing heavy imported
from harness.engines import ENGINES
from harness.models.real_shapes import ARCHS  # the shapes archs (a table; torch and transformers stay unimported)
from harness.config.checks import (
    _select, _sere_on, _vllm, _vz_on, at_least, existing_file, number, one_of, optional, pattern, registered, Check,
    ConfigError, CrossRule, NONEMPTY, Rule, _MISSING)
from harness.metrics.scoring import clip_backend, Scorer
from harness.run.rules_latency import LATENCY_CROSS_RULES, LATENCY_RULES
from harness.run.rules_offload import (
    _offload_caches, LEASE_CROSS_RULES, LEASE_RULES, OFFLOAD_CROSS_RULES, OFFLOAD_RULES, PREFETCH_RULES)

def _loader_target_ok(value: Any) -> bool:
    """``dataset.loader``: ``package.module:function`` with a module Python can find (not imported here)."""
    import importlib.util
    import re

    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", value):
        return False
    try:
        return importlib.util.find_spec(value.partition(":")[0]) is not None
    except (ImportError, ValueError):
        return False


#: Rules on one key each. Enumerations follow the code that reads the key (the registries of engines and
#: loaders, the experts registry of harness.engines.hf.engine, the VisionZip scopes); ranges follow what the code
#: can honour (a batch of 0 runs as 1, a keep rate above 1 prunes nothing).
RULES: tuple[Rule, ...] = (
    # model
    Rule("model.name", NONEMPTY),
    Rule("model.weights", one_of("real", "random-init", "trained-synthetic")),
    Rule("model.seed", at_least(0)),
    Rule("model.max_images_per_prompt", at_least(1)),
    # dataset
    Rule("dataset.loader", optional(Check(_loader_target_ok, "a 'package.module:function' whose module is importable"),
                                    "the loader registered under dataset.name")),
    Rule("dataset.name", registered(LOADERS)),
    Rule("dataset.limit", optional(at_least(1), "every sample")),
    Rule("dataset.format", optional(one_of("json", "tsv", "hf"), "detect")),
    Rule("dataset.language", one_of("zh", "en")),
    Rule("dataset.n_per_source", optional(at_least(1), "every sample of each source")),
    Rule("dataset.images_per_request", at_least(1)),
    Rule("dataset.seed", at_least(0)),
    # engine
    Rule("engine.name", registered(ENGINES)),
    Rule("engine.device", pattern(r"auto|cpu|cuda(:\d+)?", "auto, cpu, cuda or cuda:N")),
    Rule("engine.dtype", one_of("auto", "float32", "bfloat16", "float16")),
    Rule("engine.batch_size", at_least(1)),
    Rule("engine.warmup", at_least(0)),
    Rule("engine.graph_states", at_least(1, "static decoder states kept captured")),
    Rule("engine.attn_implementation",
         Check(lambda v: v in ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
               or (isinstance(v, str) and "/" in v),
               "one of sdpa, eager, flash_attention_2, flash_attention_3, flex_attention, or a hub kernel org/name")),
    Rule("engine.decode_attention", one_of("auto", "triton", "sdpa"), when=lambda cfg: cfg.engine.name == "hf"),
    Rule("engine.decode_router", one_of("auto", "triton", "torch"), when=lambda cfg: cfg.engine.name == "hf"),
    Rule("engine.experts_implementation",
         optional(one_of("auto", "harness_fused_moe", "grouped_mm", "batched_mm", "eager"), "transformers' default"),
         when=lambda cfg: cfg.engine.name == "hf"),
    Rule("engine.max_model_len", at_least(1)),
    Rule("engine.gpu_memory_utilization", number(0, 1, lo_open=True)),
    Rule("engine.tensor_parallel_size", at_least(1)),
    # generation
    Rule("generation.max_new_tokens", at_least(1)),
    # load (engine=vllm)
    Rule("load.qps", optional(number(0, lo_open=True), "offline run")),
    Rule("load.num_requests", optional(at_least(1), "one pass over the dataset")),
    Rule("load.burstiness", number(0, lo_open=True, note="1 = Poisson")),
    Rule("load.warmup", at_least(0)),
    Rule("load.seed", at_least(0)),
    Rule("load.endpoint", optional(pattern(r"auto|https?://\S+", "auto or an http(s)://host:port URL"),
                                   "AsyncLLM in process")),
    Rule("load.server_timeout_s", number(0, lo_open=True)),
    Rule("load.image_format", one_of("png", "jpeg")),
    Rule("load.jpeg_quality", number(1, 95)),
    # VisionZip
    Rule("visionzip.keep", number(0, 1, lo_open=True, note="1.0 = off")),
    Rule("visionzip.contextual", number(0, 1)),
    Rule("visionzip.scope", one_of("request", "image")),
    Rule("visionzip.layer", number(integer=True, note="-1 = last; checked against the vision depth")),
    Rule("visionzip.min_per_image", at_least(0)),
    # trivial baselines (issue 31; the names of harness/techniques/visionzip/baselines.py's METHODS)
    Rule("visionzip.method", one_of("attention", "random", "pool", "first")),
    Rule("visionzip.seed", at_least(0)),
    # SERE (k=0 is normalised to null before the rules run: see NORMALIZE)
    Rule("sere.k", optional(at_least(1, "below the model's experts per token"), "off, as is 0")),
    Rule("sere.rho", number(0, 1)),
    Rule("sere.protect", at_least(0, "below the model's number of experts")),
    Rule("sere.similarity", optional(Check(existing_file, "an existing file"), "calibrate once and cache")),
    Rule("sere.protection", optional(Check(existing_file, "an existing file"), "build when sere.protect > 0")),
    # plain top-K truncation (the `moe` group; inert until it exists)
    Rule("moe.top_k", optional(at_least(1, "below the model's experts per token"), "the model's top-k")),
    Rule("moe.scope", one_of("decode", "all")),
    # trivial routing baselines of SERE (issue 31; harness/techniques/moe_routing.py's ROUTINGS)
    Rule("moe.routing", optional(one_of("random_p", "top_p"), "off")),
    Rule("moe.k_primary", at_least(1, "below the model's experts per token")),
    Rule("moe.p", number(0, 1, lo_open=True)),
    Rule("moe.seed", at_least(0)),
    # scoring
    Rule("scoring.rouge_variant", one_of("reference", "rouge_score")),
    Rule("scoring.stopwords", optional(Check(lambda v: v in ("public", "project", "none") or existing_file(v),
                                             "public, project, none or an existing stopword file"), "public")),
    Rule("scoring.mcq_extraction", one_of("vlmevalkit", "vlmevalkit_2025", "lenient")),
    Rule("scoring.reference_faults", optional(one_of("score", "error"), "score")),
    Rule("scoring.image_zero", optional(one_of("score", "hallucination"), "score")),
    # W&B
    Rule("wandb.mode", one_of("online", "offline", "disabled")),
    Rule("wandb.project", NONEMPTY),
    Rule("wandb.job_type", NONEMPTY),
    Rule("wandb.tags", Check(lambda v: all(isinstance(t, str) and t for t in v), "a list of non-empty strings")),
    # generation cache
    Rule("cache.path", NONEMPTY),
    Rule("cache.read", one_of("resume", "always", "never")),
    Rule("seed", at_least(0)),
    # --- real-shape models, synthetic load, decode path, device_map (issue 17; docs/real_shapes.md) ---
    Rule("model.shapes.arch", optional(one_of(*ARCHS), "load model.path")),
    Rule("model.shapes.num_layers", optional(at_least(1), "the checkpoint's")),
    Rule("dataset.n_images", at_least(0)),
    Rule("dataset.image_width", at_least(1)),
    Rule("dataset.image_height", at_least(1)),
    Rule("dataset.prompt_tokens", at_least(1)),
    Rule("dataset.output_tokens", at_least(1)),
    Rule("dataset.num_requests", at_least(1)),
    Rule("engine.decode_path", one_of("auto", "compiled", "graph", "eager")),
    Rule("engine.compile_mode", one_of("default", "max-autotune-no-cudagraphs",
                                       note="CUDA graphs are the engine's own, around the compiled regions")),
    Rule("engine.compile_backend", one_of("inductor", "aot_eager")),
    Rule("engine.device_map", optional(pattern(r"auto|balanced|balanced_low_0|sequential|cpu|cuda(:\d+)?",
                                               "auto, balanced, balanced_low_0, sequential, cpu, cuda or cuda:N"),
                                       "everything on engine.device")),
    *OFFLOAD_RULES,
)


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
CROSS_RULES: tuple[CrossRule, ...] = (
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





@dataclass(frozen=True)
class Normalize:
    """``key`` with a value for which ``matches`` holds is replaced by ``value`` (``note`` is printed)."""

    key: str
    matches: Callable[[Any], bool]
    value: Any
    note: str


NORMALIZE: tuple[Normalize, ...] = (
    Normalize("sere.k", lambda v: v == 0 and not isinstance(v, bool), None,
              "sere.k=0 is SERE off (the reference's identity): recorded as sere.k=null"),
)




#: The feature blocks, appended in this order (the first refusal a config meets is the one reported).
RULES = RULES + LEASE_RULES + PREFETCH_RULES + LATENCY_RULES
CROSS_RULES = CROSS_RULES + OFFLOAD_CROSS_RULES + LEASE_CROSS_RULES + LATENCY_CROSS_RULES


# ---------------------------------------------------------------------------------- values of the model


@dataclass(frozen=True)
class ModelFacts:
    """What the checkpoint's ``config.json`` decides (None where the architecture has no such thing)."""

    num_experts: int | None = None
    experts_per_token: int | None = None
    vision_depth: int | None = None


@dataclass(frozen=True)
class ModelRule:
    """``key`` checked against a number of the model (:class:`ModelFacts` attribute ``fact``)."""

    key: str
    fact: str
    applies: Callable[[Any], bool]
    ok: Callable[[Any, int], bool]
    allowed: Callable[[int], str]


def _moe_top_k(cfg: Any) -> Any:
    return _select(cfg, "moe.top_k", None)


MODEL_RULES: tuple[ModelRule, ...] = (
    ModelRule("visionzip.layer", "vision_depth", _vz_on, lambda v, d: -d <= v < d,
              lambda d: f"an integer in [{-d}, {d - 1}] (the vision tower has {d} blocks)"),
    ModelRule("sere.k", "experts_per_token", _sere_on,
              lambda v, k: 1 <= v < k, lambda k: f"an integer in [1, {k - 1}] (the model routes each token to {k} "
                                                 "experts; sere.k >= that moves nothing; 0 or null = off)"),
    ModelRule("sere.protect", "num_experts", _sere_on, lambda v, e: 0 <= v < e,
              lambda e: f"an integer in [0, {e - 1}] (the model has {e} experts per layer)"),
    ModelRule("offload.capacity", "num_experts", lambda cfg: _offload_caches(cfg) and cfg.offload.capacity is not None,
              lambda v, e: 1 <= v <= e, lambda e: f"an integer in [1, {e}] (slots per MoE layer; the model has {e} "
                                                  "experts per layer)"),
    ModelRule("moe.top_k", "experts_per_token", lambda cfg: _moe_top_k(cfg) is not None,
              lambda v, k: 1 <= v < k, lambda k: f"an integer in [1, {k - 1}] (the model's top-k is {k}; null = "
                                                 "unchanged)"),
)


def model_facts(config: dict[str, Any]) -> ModelFacts:
    """:class:`ModelFacts` from a ``config.json`` (Qwen3-VL-MoE nests ``text_config``/``vision_config``; text-only
    MoE models keep the numbers at the top level)."""
    text = config.get("text_config") or config
    vision = config.get("vision_config") or {}

    def first(d: dict[str, Any], *names: str) -> int | None:
        return next((int(d[n]) for n in names if isinstance(d.get(n), int)), None)

    return ModelFacts(num_experts=first(text, "num_experts", "num_local_experts", "n_routed_experts"),
                      experts_per_token=first(text, "num_experts_per_tok", "moe_top_k"),
                      vision_depth=first(vision, "depth", "num_hidden_layers"))


def read_model_config(model_path: str) -> dict[str, Any] | None:
    """The checkpoint's ``config.json`` (a local directory, or the hub cache / hub), or None if unreadable:
    then the engine's own loading reports the problem."""
    local = Path(model_path).expanduser()
    try:
        if local.is_dir():
            return json.loads((local / "config.json").read_text(encoding="utf-8"))
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", str(model_path)):
            return None  # neither a directory nor a hub id: the engine decides what it is
        from huggingface_hub import hf_hub_download

        try:  # the hub cache first: no network for a checkpoint already there
            path = hf_hub_download(repo_id=model_path, filename="config.json", local_files_only=True)
        except Exception:  # noqa: BLE001 - not cached: fetch the one small file the weights load would fetch first
            path = hf_hub_download(repo_id=model_path, filename="config.json")
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - not readable here: loading the model will say why
        return None


# ----------------------------------------------------------------------------------------------- passes


def refusal(key: str, value: Any, allowed: str) -> ConfigError:
    """The one-line error: ``visionzip.keep=1.5 is not allowed: expected a number in (0, 1] (1.0 = off)``."""
    shown = "null" if value is None else (value if isinstance(value, (int, float, bool)) else repr(value))
    if isinstance(value, bool):
        shown = str(value).lower()
    return ConfigError(f"{key}={shown} is not allowed: expected {allowed}")


def schema_keys() -> Any:
    """The schema as an OmegaConf node (``harness.config.schema.Config``), for :func:`check_keys`."""
    from omegaconf import OmegaConf

    from harness.config.schema import Config

    return OmegaConf.structured(Config)


def check_keys(cfg: Any, schema: Any = None, prefix: str = "") -> None:
    """Refuse keys the schema does not have (Hydra's ``+key=value`` adds them even to struct configs).
    Free-form dict fields of the schema (``dataset.sources``) accept any key."""
    from omegaconf import DictConfig, ListConfig

    schema = schema_keys() if schema is None else schema
    allowed = list(schema.keys())  # not `key in schema`: a DictConfig hides keys whose value is ??? (MISSING)
    for key in cfg.keys():
        full = f"{prefix}{key}"
        if key not in allowed:
            known = ", ".join(str(k) for k in allowed)
            node = cfg._get_node(key)
            shown = "" if isinstance(node, (DictConfig, ListConfig)) else f"={node._value()}"
            raise ConfigError(f"{full}{shown} is not a config key: {prefix.rstrip('.') or 'the config'} has {known}")
        sub, sub_schema = cfg._get_node(key), schema._get_node(key)
        if isinstance(sub, DictConfig) and isinstance(sub_schema, DictConfig) and sub_schema.keys() \
                and not sub._is_none():
            check_keys(sub, sub_schema, f"{full}.")


def validate_config(cfg: Any) -> list[str]:
    """Refuse (``ConfigError``) any value outside :data:`RULES` / :data:`CROSS_RULES`; apply :data:`NORMALIZE`.
    Returns the notes of applied normalisations (also printed to stderr). Before any model loads."""
    check_keys(cfg)
    loader = _select(cfg, "dataset.loader")
    if loader is not _MISSING and loader is not None and _loader_target_ok(loader):
        register_from_config(cfg.dataset)  # a dataset from outside the package (README), as load_samples does
    notes = []
    for n in NORMALIZE:
        value = _select(cfg, n.key)
        if value is not _MISSING and n.matches(value):
            from omegaconf import OmegaConf

            OmegaConf.update(cfg, n.key, n.value, merge=False)
            notes.append(n.note)
            print(f"note: {n.note}", file=sys.stderr)
    for rule in RULES:
        value = _select(cfg, rule.key)
        if value is _MISSING or (rule.when is not None and not rule.when(cfg)):
            continue
        if not rule.check.ok(value):
            raise refusal(rule.key, value, rule.check.text())
    for rule in CROSS_RULES:
        value = _select(cfg, rule.key)
        if value is _MISSING:
            value = None
        if rule.applies(cfg) and not rule.ok(cfg):
            raise refusal(rule.key, value, rule.allowed(cfg) if callable(rule.allowed) else rule.allowed)
    return notes


def validate_model(cfg: Any, model_path: str, config: dict[str, Any] | None = None) -> ModelFacts | None:
    """Check :data:`MODEL_RULES` against the checkpoint's ``config.json`` (read here when not given), before
    its weights load. Returns the facts read (None when the config could not be read)."""
    config = read_model_config(model_path) if config is None else config
    if config is None:
        return None
    facts = model_facts(config)
    for rule in MODEL_RULES:
        value, limit = _select(cfg, rule.key), getattr(facts, rule.fact)
        if value is _MISSING or value is None or limit is None or not rule.applies(cfg):
            continue
        if not rule.ok(value, limit):
            raise refusal(rule.key, value, rule.allowed(limit) + f" for {os.path.basename(str(model_path))}")
    return facts


# --------------------------------------------------------------------- Hydra's own errors, in one line


def hydra_error_line(exc: BaseException) -> str | None:
    """One line for a Hydra composition / override error (a misspelt key, a wrong type, an unknown option), or
    None when ``exc`` is not one: Hydra's message spans several lines and suggests ``+key`` for a misspelt key,
    which would add a key nothing reads."""
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    if isinstance(exc, OverrideParseException):
        return f"command line: {str(exc).splitlines()[0]} (Hydra override grammar)"
    if isinstance(exc, MissingConfigException):
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        options = [line for line in lines[2:] if not line.startswith(("Config search path", "provider="))
                   and not line.endswith("_schema")]
        head = lines[0].split(": ", 1)[-1] if lines else str(exc)
        m = re.search(r"Could not find '(.+)/([^/']+)'", head)
        if m:
            group, option = m.groups()
            return f"{group}={option} is not an option: {group} has {', '.join(options) or 'no options'}"
        return f"{head}; available: {', '.join(options)}" if options else head
    if isinstance(exc, ConfigCompositionException):
        cause = exc.__cause__
        if isinstance(cause, OmegaConfBaseException):
            key = getattr(cause, "full_key", None) or ""
            first = str(cause).splitlines()[0]
            if isinstance(cause, (ConfigKeyError,)) or "not in" in first:
                parent = key.rsplit(".", 1)[0] if "." in key else ""
                try:
                    node = schema_keys()
                    for part in filter(None, parent.split(".")):
                        node = node[part]
                    known = ", ".join(str(k) for k in node.keys())
                except Exception:  # noqa: BLE001
                    known = "see python -m harness --help"
                return f"{key} is not a config key: {parent or 'the config'} has {known}"
            if isinstance(cause, ValidationError):
                return f"{key}: {first}"
            return f"{key}: {first}" if key else first
        return str(exc).splitlines()[0]
    return None
