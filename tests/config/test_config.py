"""The Hydra configuration composes for every group option and rejects bad keys and types; every config value
the issue tried (and more) is refused before any model loads with one line naming the key, or accepted
(harness/run/validate.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ValidationError

from harness.config.schema import GROUP_SCHEMAS, register_configs

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "harness/conf"


@pytest.fixture
def compose_cfg():
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield lambda overrides=(): compose(config_name="config", overrides=list(overrides))
    GlobalHydra.instance().clear()


def group_options() -> list[tuple[str, str]]:
    return [(g, o) for g in GROUP_SCHEMAS for o in _options(g)]


def _options(group: str) -> list[str]:
    return [f.stem for f in sorted((CONF / group).glob("*.yaml"))]


def test_every_group_has_a_yaml_and_a_schema():
    for group in GROUP_SCHEMAS:
        assert list((CONF / group).glob("*.yaml")), f"no options for group {group}"


@pytest.mark.parametrize("group,option", group_options())
def test_every_option_composes(compose_cfg, group, option):
    cfg = compose_cfg([f"{group}={option}"])
    node = OmegaConf.to_object(cfg[group])  # instantiates the dataclass: types checked
    assert isinstance(node, GROUP_SCHEMAS[group])


def test_defaults_are_the_embedded_path(compose_cfg):
    cfg = compose_cfg()
    assert cfg.model.embedded and cfg.model.weights == "trained-synthetic"  # model=tiny: the committed checkpoint
    assert cfg.dataset.name == "rag_igbench"
    assert cfg.engine.name == "hf"
    assert cfg.visionzip.keep == 1.0 and cfg.sere.k is None
    assert cfg.wandb.mode == "offline"


def test_technique_knobs_are_plain_overrides(compose_cfg):
    cfg = compose_cfg(["sere.k=2", "visionzip.keep=0.6"])
    assert cfg.sere.k == 2 and cfg.visionzip.keep == 0.6


def test_misspelt_key_is_rejected(compose_cfg):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(["sere.kk=2"])
    assert "kk" in str(e.value.__cause__ or e.value)


def test_wrong_type_is_rejected(compose_cfg):
    with pytest.raises((ConfigCompositionException, ValidationError)) as e:
        compose_cfg(["engine.batch_size=two"])
    assert "batch_size" in str(e.value.__cause__ or e.value)


def test_unknown_key_in_struct_config_cannot_be_added_later(compose_cfg):
    cfg = compose_cfg()
    with pytest.raises(ConfigAttributeError):
        cfg.sere.nonexistent = 1


def test_help_lists_the_groups():
    out = subprocess.run([sys.executable, "-m", "harness", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    for group in ("model", "dataset", "engine", "visionzip", "sere", "wandb"):
        assert f"{group}:" in out


# ------------------------------------------------------------------------------------- real-model defaults


def test_real_model_composes_the_reference_scorers_and_answer_length(compose_cfg):
    cfg = compose_cfg(["model=qwen3_vl_30b_a3b"])
    assert cfg.model.weights == "real"
    assert (cfg.scoring.clip_model, cfg.scoring.clip_pretrained) == ("ViT-L-14", "openai")
    assert cfg.scoring.embed_model == "TencentBAC/Conan-embedding-v1"
    assert cfg.generation.max_new_tokens == 2048  # RAG-IGBench's reference generations
    # the command line still wins over the model's choices
    cfg = compose_cfg(["model=qwen3_vl_30b_a3b", "generation.max_new_tokens=256", "scoring.embed_model=null"])
    assert cfg.generation.max_new_tokens == 256 and cfg.scoring.embed_model is None
    assert compose_cfg().scoring.clip_model.endswith("/metrics/checkpoints/tiny-clip-trained-synthetic")  # trained
    assert compose_cfg().generation.max_new_tokens == 192


def test_summary_records_random_scorers():
    from harness.metrics.scoring import Scorer

    d = Scorer(OmegaConf.create({"rouge_variant": "reference", "clip_model": "tiny", "clip_pretrained": None,
                                 "embed_model": "tiny", "allow_random_scorers": True})).describe()
    assert d["clip_weights"] == d["embed_weights"] == "random-init" and d["allow_random_scorers"] is True


# ----------------------------------------------------------------------------- validation: the table


def _tiny_model_config() -> dict:
    """What the embedded model's config.json says, from its spec (16 experts, top-4, a 4-block vision tower)."""
    from harness.models.tiny import TinyModelSpec

    spec = TinyModelSpec()
    return {"text_config": {"num_experts": spec.num_experts, "num_experts_per_tok": spec.num_experts_per_tok},
            "vision_config": {"depth": spec.vision_depth}}


VZ, VLLM, QWEN = "visionzip.keep=0.6", "engine=vllm", "model=qwen3_vl_30b_a3b"
LRU = "offload.policy=lru"
OFFLOAD_CASES: list[tuple[tuple[str, ...], str | None]] = [
    (("offload.policy=mru",), "offload.policy"),
    ((LRU,), "offload.capacity"),  # a cache policy needs a size
    ((LRU, "offload.capacity=0"), "offload.capacity"),
    ((LRU, "offload.capacity=17"), "offload.capacity"),  # more slots than the model's 16 experts per layer
    ((LRU, "offload.capacity=16"), None),
    ((LRU, "offload.capacity=4", "offload.capacity_gb=1"), "offload.capacity"),  # exactly one of the two
    ((LRU, "offload.capacity_gb=0"), "offload.capacity_gb"),
    ((LRU, "offload.capacity_gb=0.01"), None),
    ((VLLM, LRU, "offload.capacity=4"), "offload.policy"),  # HF engine only
    (("offload.policy=oracle", "offload.capacity=4"), "offload.trace"),  # Belady needs the future
    (("offload.policy=oracle", "offload.capacity=4", "offload.trace=/no/such/trace.pt"), "offload.trace"),
    (("offload.policy=none",), None),  # all resident: no capacity needed
    (("offload.gpu_budget_gb=-1",), "offload.gpu_budget_gb"),
    (("offload.warm_after_tokens=-1",), "offload.warm_after_tokens"),
    ((LRU, "offload.capacity=4", "+offload.params.threshold=0.7"), None),  # policy parameters are free-form
    (("+offload.capcity=4",), "offload.capcity"),
    # issue 26: found after the model loaded, or never
    ((LRU, "offload.capacity_gb=inf"), "offload.capacity_gb"),  # was OverflowError after the weights loaded
    ((LRU, "offload.capacity=4", "offload.gpu_budget_gb=inf"), "offload.gpu_budget_gb"),
    (("offload.capacity=4",), "offload.capacity"),  # no policy: was accepted and ignored
    (("offload.capacity_gb=1",), "offload.capacity_gb"),
    (("offload.policy=none", "offload.capacity=4"), "offload.capacity"),  # all resident: nothing to size
    (("offload.record_trace=results/traces/t1",), "offload.record_trace"),  # no policy: nothing recorded
    (("offload.policy=none", "offload.record_trace=/dev/full"), "offload.record_trace"),  # wrote /dev/full.pt
    (("offload.policy=none", "offload.record_trace=/proc/self/trace"), "offload.record_trace"),
    (("offload.policy=none", "offload.record_trace=results/traces/t1"), None),
]
# offload.lease / offload.threshold (issue 15, lease policy: harness/techniques/offload/lease.py, docs/offload_lease.md)
LEASE = ("offload.policy=lease", "offload.capacity=4")
LEASE_CASES: list[tuple[tuple[str, ...], str | None]] = [
    (LEASE, None),  # default score: recency (no artifact needed)
    ((*LEASE, "offload.threshold=0.7"), None),
    ((*LEASE, "offload.threshold=1.5"), "offload.threshold"),
    ((*LEASE, "offload.lease.length=0"), "offload.lease.length"),
    ((*LEASE, "offload.lease.length=8", "offload.lease.long_length=4"), "offload.lease.long_length"),
    ((*LEASE, "offload.lease.grace_ms=-1"), "offload.lease.grace_ms"),
    ((*LEASE, "offload.lease.grace_tokens=-2"), "offload.lease.grace_tokens"),
    ((*LEASE, "offload.lease.grace_tokens=20", "offload.lease.grace_ms=0"), None),
    ((*LEASE, "offload.lease.grace_mode=adaptive"), "offload.lease.grace_mode"),
    ((*LEASE, "offload.lease.grace_mode=dynamic"), None),
    ((*LEASE, "offload.lease.score=oracle"), "offload.lease.score"),
    ((*LEASE, "offload.lease.score=predictor"), "offload.lease.predictor"),  # the MLP needs its artifact
    ((*LEASE, "offload.lease.score=predictor", "offload.lease.predictor=/no/such.pt"), "offload.lease.predictor"),
    ((*LEASE, "offload.lease.prefetch=oracle"), "offload.lease.prefetch"),
    ((*LEASE, "offload.lease.preemptible=false"), None),
]
# offload.prefetch (issue 15, offload-prefetch: harness/techniques/offload/prefetch.py, docs/offload.md)
PREFETCH_CASES: list[tuple[tuple[str, ...], str | None]] = [
    ((LRU, "offload.capacity=4", "offload.policy=lru+gate"), None),
    ((LRU, "offload.capacity=4", "offload.prefetch.max_per_layer=0", "offload.prefetch.max_inflight=0",
      "offload.prefetch.protect_tokens=0", "offload.prefetch.stream=shared"), None),  # the legacy behaviour
    ((LRU, "offload.capacity=4", "offload.prefetch.max_per_layer=-1"), "offload.prefetch.max_per_layer"),
    ((LRU, "offload.capacity=4", "offload.prefetch.max_inflight=-1"), "offload.prefetch.max_inflight"),
    ((LRU, "offload.capacity=4", "offload.prefetch.protect_tokens=1.5"), "offload.prefetch.protect_tokens"),
    ((LRU, "offload.capacity=4", "offload.prefetch.stream=priority"), "offload.prefetch.stream"),
]
# (overrides, the key a refusal must name, or None = accepted). Model-decided values are checked against the
# embedded model's config.json: 16 experts per layer, 4 per token, 4 vision blocks.
SHP, SHPVL, LOAD = "model=qwen3_30b_a3b_shapes", "model=qwen3_vl_30b_a3b_shapes", "dataset=synthetic_load"

CASES: list[tuple[tuple[str, ...], str | None]] = [
    # VisionZip
    (("visionzip.keep=1.5",), "visionzip.keep"),
    (("visionzip.keep=0",), "visionzip.keep"),
    (("visionzip.keep=-0.1",), "visionzip.keep"),
    (("visionzip.keep=0.6",), None),
    (("visionzip.keep=1.0",), None),
    ((VZ, "visionzip.contextual=1.5"), "visionzip.contextual"),
    ((VZ, "visionzip.contextual=0.2"), None),
    (("visionzip.scope=bogus",), "visionzip.scope"),
    ((VZ, "visionzip.scope=image"), None),
    (("visionzip.min_per_image=-1",), "visionzip.min_per_image"),
    ((VZ, "visionzip.layer=10"), "visionzip.layer"),
    ((VZ, "visionzip.layer=-5"), "visionzip.layer"),
    ((VZ, "visionzip.layer=3"), None),
    ((VZ, "visionzip.layer=-4"), None),
    (("visionzip.layer=10",), None),  # VisionZip off: the layer is not used
    (("visionzip.keep=abc",), "visionzip.keep"),
    # SERE
    (("sere.k=100",), "sere.k"),
    (("sere.k=4",), "sere.k"),  # = the model's top-k: would move nothing
    (("sere.k=2",), None),
    (("sere.k=3",), None),
    (("sere.k=0",), None),  # SERE off, recorded as null (test below)
    (("sere.k=-1",), "sere.k"),
    (("sere.rho=1.5",), "sere.rho"),
    (("sere.rho=-0.1",), "sere.rho"),
    (("sere.rho=0",), None),
    (("sere.rho=1",), None),
    (("sere.protect=-1",), "sere.protect"),
    (("sere.k=2", "sere.protect=16"), "sere.protect"),
    (("sere.k=2", "sere.protect=15"), None),
    (("sere.similarity=/nonexistent/sim.pt",), "sere.similarity"),
    (("+sere.kk=2",), "sere.kk"),  # Hydra's own suggestion for a misspelt key: a key nothing reads
    (("sere.kk=2",), "sere.kk"),
    (("+unknown.key=1",), "unknown"),
    (("+engine.batchsize=8",), "engine.batchsize"),
    # engine
    (("engine.batch_size=0",), "engine.batch_size"),
    (("engine.batch_size=-3",), "engine.batch_size"),
    (("engine.batch_size=two",), "engine.batch_size"),
    (("engine.batch_size=8",), None),
    (("engine.name=other",), "engine.name"),
    ((VLLM,), None),
    (("engine.dtype=fp8",), "engine.dtype"),
    (("engine.dtype=bfloat16",), None),
    (("engine.device=gpu",), "engine.device"),
    (("engine.device=cuda:1",), None),
    (("engine.warmup=-1",), "engine.warmup"),
    (("engine.graph_states=0",), "engine.graph_states"),
    (("engine.graph_states=8",), None),
    (("engine.experts_implementation=magic",), "engine.experts_implementation"),
    (("engine.experts_implementation=grouped_mm",), None),
    (("engine.attn_implementation=bogus",), "engine.attn_implementation"),
    ((VLLM, "engine.gpu_memory_utilization=1.5"), "engine.gpu_memory_utilization"),
    ((VLLM, "engine.tensor_parallel_size=0"), "engine.tensor_parallel_size"),
    ((VLLM, "engine.max_model_len=0"), "engine.max_model_len"),
    (("engine=bogus",), "engine"),
    # generation
    (("generation.max_new_tokens=0",), "generation.max_new_tokens"),
    (("generation.max_new_tokens=-5",), "generation.max_new_tokens"),
    (("generation.max_new_tokens=2048",), None),
    (("generation.do_sample=maybe",), "generation.do_sample"),
    # dataset
    (("dataset.limit=0",), "dataset.limit"),
    (("dataset.limit=2",), None),
    (("dataset.language=fr",), "dataset.language"),
    (("dataset.language=en",), None),
    (("dataset.format=xml",), "dataset.format"),
    (("dataset.name=bogus",), "dataset.name"),
    (("dataset=ocr_cc_mix_sample", "dataset.images_per_request=0"), "dataset.images_per_request"),
    (("dataset=ocr_cc_mix_sample", "dataset.n_per_source=0"), "dataset.n_per_source"),
    (("dataset=ccbench_sample",), None),
    # load (vLLM)
    (("load.qps=4",), "load.qps"),  # engine=hf has no load mode
    ((VLLM, "load.qps=4"), None),
    ((VLLM, "load.qps=0"), "load.qps"),
    ((VLLM, "load.qps=4", "load.burstiness=0"), "load.burstiness"),
    ((VLLM, "load.qps=4", "load.num_requests=0"), "load.num_requests"),
    ((VLLM, "load.warmup=-1"), "load.warmup"),
    # vllm serve load mode (load.endpoint)
    ((VLLM, "load.qps=4", "load.endpoint=auto"), None),
    ((VLLM, "load.qps=4", "load.endpoint=http://127.0.0.1:8000"), None),
    ((VLLM, "load.qps=4", "load.endpoint=localhost:8000"), "load.endpoint"),
    ((VLLM, "load.endpoint=auto"), "load.endpoint"),  # the serve mode is a load test
    (("load.endpoint=auto",), "load.endpoint"),  # engine=hf
    ((VLLM, "load.qps=4", "load.endpoint=auto", "load.server_timeout_s=0"), "load.server_timeout_s"),
    # sampling: only the serve load client samples; elsewhere the key would be ignored, so it is refused
    ((VLLM, "load.qps=4", "load.endpoint=auto", "generation.do_sample=true"), None),
    (("generation.do_sample=true",), "generation.do_sample"),  # engine=hf decodes greedily
    ((VLLM, "load.qps=4", "generation.do_sample=true"), "generation.do_sample"),  # AsyncLLM in process: greedy
    ((VLLM, "load.qps=4", "load.endpoint=auto", "load.image_format=jpeg", "load.jpeg_quality=80"), None),
    ((VLLM, "load.qps=4", "load.image_format=jpeg"), "load.image_format"),  # AsyncLLM takes PIL images
    (("load.image_format=webp",), "load.image_format"),
    ((VLLM, "load.qps=4", "load.endpoint=auto", "load.image_format=jpeg", "load.jpeg_quality=0"), "load.jpeg_quality"),
    # VisionZip in vLLM
    ((VLLM, VZ), None),  # scope=request (the default) through the bundle item
    ((VLLM, VZ, "visionzip.contextual=0.2"), None),
    ((VLLM, VZ, "visionzip.min_per_image=0"), None),
    ((VLLM, VZ, "visionzip.scope=image"), None),
    ((VLLM, VZ, "visionzip.scope=image", "visionzip.min_per_image=0"), "visionzip.min_per_image"),
    ((VLLM, VZ, "visionzip.scope=image", "visionzip.contextual=0.2"), "visionzip.contextual"),
    # W&B
    (("wandb.mode=ofline",), "wandb.mode"),
    (("wandb.mode=online",), None),
    (("wandb.mode=disabled",), None),
    (("wandb.project=''",), "wandb.project"),
    (("wandb.tags=[a,'']",), "wandb.tags"),
    # generation cache
    (("cache.read=sometimes",), "cache.read"),
    (("cache.read=never",), None),
    (("cache.path=''",), "cache.path"),
    # model and scoring
    (("seed=-1",), "seed"),
    (("model.weights=fake",), "model.weights"),
    (("model.max_images_per_prompt=0",), "model.max_images_per_prompt"),
    ((QWEN,), None),  # real weights with the reference scorers
    ((QWEN, "scoring=default", "scoring.clip_model=tiny", "scoring.embed_model=tiny"),
     "scoring.allow_random_scorers"),  # real weights, random-init scorers
    ((QWEN, "scoring.clip_model=tiny"), "scoring.allow_random_scorers"),
    ((QWEN, "scoring.clip_model=ViT-B-32", "scoring.clip_pretrained=null"), "scoring.allow_random_scorers"),
    ((QWEN, "scoring=default"), "scoring.allow_random_scorers"),  # trained-synthetic scorers on a real model
    ((QWEN, "scoring=default", "scoring.allow_random_scorers=true"), None),
    ((QWEN, "scoring.clip_model=null", "scoring.embed_model=null"), None),
    ((QWEN, "model.path=null"), "model.path"),
    (("scoring.rouge_variant=bogus",), "scoring.rouge_variant"),
    (("scoring.clip_model=transformers:openai/clip-vit-large-patch14",), None),
    # latency measurement protocol (harness/latency/, docs/latency.md)
    (("latency.repeats=0",), "latency.repeats"),
    (("latency.repeats=5",), None),
    (("latency.warmup=all",), "latency.warmup"),
    (("latency.warmup=first_batch",), None),
    (("latency.bucket=0",), "latency.bucket"),
    (("latency.bucket=64",), None),
    (("latency.on_compile=ignore",), "latency.on_compile"),
    (("latency.on_compile=exclude",), None),
    (("latency.max_retime=-1",), "latency.max_retime"),
    (("latency.max_cv=0",), "latency.max_cv"),
    (("latency.max_cv=null",), None),
    (("latency.confidence=1",), "latency.confidence"),
    (("latency.bootstrap_resamples=10",), "latency.bootstrap_resamples"),
    (("latency.lock_timeout_s=0",), "latency.lock_timeout_s"),
    (("latency.sequential=true",), None),
    ((VLLM, "load.qps=4", "latency.repeats=3"), "latency.repeats"),  # load mode: one stream
    # real-shape models, synthetic load, decode path, device_map (issue 17; docs/real_shapes.md)
    ((SHP, LOAD), None),
    ((SHPVL, LOAD, "dataset.n_images=30", "sere.k=2", "engine.batch_size=16"), None),
    ((SHP, LOAD, "dataset.n_images=-1"), "dataset.n_images"),
    ((SHP, LOAD, "dataset.n_images=2"), "dataset.n_images"),  # a text-only model
    ((SHP, LOAD, "dataset.prompt_tokens=0"), "dataset.prompt_tokens"),
    ((SHP, LOAD, "dataset.output_tokens=0"), "generation.max_new_tokens"),  # = ${dataset.output_tokens}, checked first
    ((SHP, LOAD, "dataset.image_width=0"), "dataset.image_width"),
    ((SHP, LOAD, "dataset.num_requests=0"), "dataset.num_requests"),
    ((SHP, LOAD, "generation.max_new_tokens=7"), "generation.max_new_tokens"),
    ((SHP, LOAD, "generation.ignore_eos=false"), "generation.ignore_eos"),
    ((LOAD,), "generation.ignore_eos"),  # another model: generation=synthetic_load is needed
    ((LOAD, "generation=synthetic_load"), None),
    ((SHP, LOAD, "model.shapes.arch=qwen3_moe"), "model.shapes.arch"),
    ((SHP, LOAD, "model.shapes.num_layers=0"), "model.shapes.num_layers"),
    ((SHP, LOAD, "model.weights=real"), "model.weights"),
    ((SHP, LOAD, "engine=vllm"), None),  # the text shapes model with vLLM's dummy weights (docs/vllm.md)
    ((SHP, LOAD, "engine=vllm", "sere.k=2", "moe.top_k=3"), None),
    ((SHP, LOAD, "engine=vllm", "load.qps=4"), None),  # AsyncLLM in process
    ((SHP, LOAD, "engine=vllm", "load.qps=4", "load.endpoint=auto"), None),  # vllm serve on the shapes config
    ((SHP, LOAD, "engine=vllm", "load.qps=4", "load.endpoint=http://127.0.0.1:8000"), "load.endpoint"),  # its model
    ((SHPVL, LOAD, "engine=vllm"), "model.shapes.arch"),  # the VL shapes model needs a processor in vLLM
    ((SHPVL, LOAD, "engine=vllm", "load.qps=1", "load.endpoint=auto", "visionzip.keep=0.5"), None),  # served
    ((LOAD, "generation=synthetic_load", "engine=vllm"), "dataset.name"),  # token ids: shapes models only
    ((SHP, LOAD, "engine.device_map=auto"), "engine.device_map"),
    (("engine.decode_path=fast",), "engine.decode_path"),
    (("engine.decode_path=compiled",), None),
    (("engine.decode_attention=flash",), "engine.decode_attention"),
    (("engine.decode_attention=sdpa",), None),
    (("engine.decode_router=fast",), "engine.decode_router"),
    (("engine.decode_router=torch",), None),
    (("engine.compile_mode=reduce-overhead",), "engine.compile_mode"),
    (("engine.compile_backend=eager",), "engine.compile_backend"),
    (("engine.device_map=everywhere",), "engine.device_map"),
    (("engine.device_map=auto",), None),
    # offload (issue 15; harness/techniques/offload, docs/offload.md)
    *OFFLOAD_CASES,
    *LEASE_CASES,
    *PREFETCH_CASES,
]


def outcome(compose_cfg, overrides) -> tuple[bool, str, object]:
    """(refused, message, cfg): what ``python -m harness OVERRIDES`` decides before any weights load."""
    from harness.run.validate import ConfigError, hydra_error_line, validate_config, validate_model

    try:
        cfg = compose_cfg(list(overrides))
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors, as the CLI prints them
        line = hydra_error_line(e)
        assert line is not None, f"{overrides}: not a composition error: {e!r}"
        return True, line, None
    try:
        validate_config(cfg)
        validate_model(cfg, "tiny", config=_tiny_model_config())
    except ConfigError as e:
        return True, str(e), cfg
    return False, "", cfg


def test_the_table_is_the_issues_size():
    assert len(CASES) >= 52 and len({c for c, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("overrides,key", CASES, ids=[" ".join(c) for c, _ in CASES])
def test_config_value_is_refused_naming_the_key_or_accepted(compose_cfg, overrides, key):
    refused, message, _ = outcome(compose_cfg, overrides)
    if key is None:
        assert not refused, message
        return
    assert refused, f"{overrides} was accepted"
    assert "\n" not in message and message.startswith(key), message  # one line, the key first
    value = overrides[-1].split("=", 1)[1] if "=" in overrides[-1] else ""
    hydra_unknown = "not a config key" in message and not overrides[-1].startswith("+")  # Hydra names no value
    if key == overrides[-1].split("=", 1)[0].lstrip("+") and value not in ("", "''") and "[" not in value \
            and not hydra_unknown:
        assert value in message, message  # and the value


def test_sere_k_0_is_recorded_as_off(compose_cfg):
    _, _, cfg = outcome(compose_cfg, ["sere.k=0"])
    assert cfg.sere.k is None  # what config.yaml / summary.json record: SERE off


def test_open_clip_model_without_open_clip_is_refused_before_the_model(compose_cfg, monkeypatch):
    import importlib.util

    from harness.run.validate import ConfigError, validate_config

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "open_clip" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^scoring.clip_model='ViT-L-14' .*\[clip\] extra"):
        validate_config(compose_cfg(["model=qwen3_vl_30b_a3b"]))
    validate_config(compose_cfg())  # the default (tiny, transformers) needs no open_clip


@pytest.mark.parametrize("overrides,key", [
    (["moe.top_k=0"], "moe.top_k"),
    (["moe.top_k=4"], "moe.top_k"),  # = the model's top-k: truncates nothing
    (["moe.scope=prefill"], "moe.scope"),
    (["moe.top_k=2"], None),
    (["moe.top_k=3", "sere.k=2"], None),  # SERE on a top-3 model
    (["moe.top_k=2", "sere.k=2"], "sere.k"),  # SERE has nothing to move (issue 26: was a note, ran as plain top-2)
    (["moe.top_k=2", "sere.k=3"], "sere.k"),  # was accepted, recording moved_fraction=None
    (["moe.top_k=2", "sere.k=0"], None),  # SERE off, as documented: plain top-2
    (["scoring.stopwords=/no/such/list.txt"], "scoring.stopwords"),
    (["scoring.stopwords=none"], None),
    (["scoring.mcq_extraction=fuzzy"], "scoring.mcq_extraction"),
    (["scoring.stopwords=public"], None),
    (["scoring.stopwords=project"], None),
    (["scoring.mcq_extraction=vlmevalkit_2025"], None),
    (["scoring.reference_faults=error"], None),
    (["scoring.reference_faults=drop"], "scoring.reference_faults"),   # refused before the model loads
    (["scoring.image_zero=hallucination"], None),
    (["scoring.image_zero=ignore"], "scoring.image_zero"),
])
def test_moe_and_scoring_choices(compose_cfg, overrides, key):
    import harness.run.validate as v

    c = compose_cfg(overrides)
    try:
        v.validate_config(c)
        v.validate_model(c, "tiny", config=_tiny_model_config())
    except v.ConfigError as e:
        assert key is not None and str(e).startswith(key), (overrides, str(e))
    else:
        assert key is None, overrides


def test_sere_at_or_above_moe_top_k_is_refused(compose_cfg):
    from harness.run.validate import ConfigError, validate_config

    with pytest.raises(ConfigError, match=r"^sere.k=3 is not allowed: expected an integer below moe.top_k=2 "):
        validate_config(compose_cfg(["moe.top_k=2", "sere.k=3"]))
    cfg = compose_cfg(["moe.top_k=2", "sere.k=0"])  # 0 is off, as README and the refusal say: plain top-2
    validate_config(cfg)
    assert cfg.sere.k is None and cfg.moe.top_k == 2


@pytest.mark.slow
@pytest.mark.parametrize("override,key", [("visionzip.keep=1.5", "visionzip.keep"), ("+sere.kk=2", "sere.kk"),
                                          ("sere.k=100", "sere.k")])
def test_cli_refuses_with_exit_2_and_one_line_before_the_model_loads(tmp_path, override, key):
    """The real command: exit code 2, one ``error:`` line naming the key, nothing written (sere.k=100 is
    checked against the built tiny model's config.json, before its weights load)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "harness", override, f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {key}"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "samples.jsonl").exists()


def test_engines_and_loaders_registered_at_run_time_are_accepted(compose_cfg, monkeypatch):
    """Registries are read when a value is checked (tests and plugins add engines after import)."""
    from harness.engines import ENGINES
    from harness.run.validate import ConfigError, validate_config

    cfg = compose_cfg(["engine.name=scripted"])
    with pytest.raises(ConfigError, match="^engine.name='scripted' is not allowed: expected one of hf, vllm$"):
        validate_config(cfg)
    monkeypatch.setitem(ENGINES, "scripted", "somewhere:Engine")
    validate_config(cfg)
