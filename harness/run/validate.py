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
3. :func:`validate_model` — :data:`~harness.run.rules_model.MODEL_RULES`: values the checkpoint decides (vision
   depth, number of experts, experts per token), checked right after the checkpoint's ``config.json`` is read,
   before weights load.

A rule whose key does not exist in the config is inert (``moe.top_k`` is checked once a ``moe`` group exists).
The vocabulary (checks, rules, the refusal) is in harness/config/checks.py. The rows live beside this module: the
core groups' rules between keys in rules_cross.py (first in :data:`CROSS_RULES`), the offload and latency groups'
rows in rules_offload.py and rules_latency.py (appended to the tables here), the checkpoint's numbers and the rows
checked against them in rules_model.py.
Only the standard library and omegaconf are imported at module level.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harness.datasets import LOADERS, register_from_config  # light registries (names → "module:attr"), nothing heavy imported
from harness.engines import ENGINES
from harness.models.real_shapes import ARCHS  # the shapes archs (a table; torch and transformers stay unimported)
from harness.config.checks import (
    _select, at_least, existing_file, number, one_of, optional, pattern, registered, Check, ConfigError, CrossRule,
    NONEMPTY, Rule, _MISSING)
from harness.run.rules_cross import CORE_CROSS_RULES
from harness.run.rules_latency import LATENCY_CROSS_RULES, LATENCY_RULES
from harness.run.rules_model import MODEL_RULES, ModelFacts, model_facts, read_model_config
from harness.run.rules_offload import (
    LEASE_CROSS_RULES, LEASE_RULES, OFFLOAD_CROSS_RULES, OFFLOAD_RULES, PREFETCH_RULES)

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
#: loaders, the experts choice of harness.engines.hf.decode_path, the VisionZip scopes); ranges follow what the code
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


#: The feature blocks, appended in this order (the first refusal a config meets is the one reported); the rules
#: between keys start with the core groups' (rules_cross.py).
RULES = RULES + LEASE_RULES + PREFETCH_RULES + LATENCY_RULES
CROSS_RULES: tuple[CrossRule, ...] = CORE_CROSS_RULES + OFFLOAD_CROSS_RULES + LEASE_CROSS_RULES + LATENCY_CROSS_RULES


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
