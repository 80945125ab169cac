"""The plugin's settings: the environment-variable contract between the harness and every vLLM process.

vLLM spawns its processes (engine core, workers, the model-inspection subprocess; ``vllm serve``'s API
server too), so the harness cannot hand them Python objects: the offline engine
(:mod:`harness.engines.vllm.engine`) and the server launcher (:mod:`harness.engines.vllm.serve`) export
these variables before vLLM starts, and :func:`harness.engines.vllm.plugin.register` reads them in each
process. One module reads and writes them all, so the two sides cannot drift apart:

========================== ==========================================================================
``HARNESS_SERE_K``          primary experts per token; unset or empty = SERE off (nothing is patched)
``HARNESS_SERE_RHO``        similarity threshold (float, default 0.1)
``HARNESS_SERE_SIMILARITY`` safetensors of the calibrated matrices (``similarity.<layer>`` [E, E] per
                            MoE layer, or one ``similarity`` [L, E, E]; ``sere_calibration.load_similarity``)
``HARNESS_SERE_PROTECTION`` optional protection artifact (``protected.<layer>`` bool [E];
                            ``sere_protection.load_protection``)
``HARNESS_SERE_PROTECT``    optional n: re-derive the top-n protected experts from the artifact's scores
``HARNESS_SERE_TRACE``      optional path: append one JSON line per routing call (tests)
``HARNESS_VZ_KEEP``         VisionZip keep < 1 = register the VisionZip Qwen3-VL-MoE architecture
``HARNESS_VZ_LAYER``        scoring vision block (default -1); ``HARNESS_VZ_MIN_PER_IMAGE`` (default 1)
``HARNESS_VZ_SCOPE``        ``request`` (one budget per request: the bundle architecture,
                            :mod:`harness.engines.vllm.visionzip_request`) | ``image`` (default when unset)
``HARNESS_VZ_CONTEXTUAL``   contextual fraction of the kept budget (scope=request; default 0)
``HARNESS_VZ_SPAN_TEXT``    text tokens between images a bundle may hold (profiling bound, default 512)
``HARNESS_MOE_TOP_K``       ``moe.top_k``: plain top-K truncation per layer (:mod:`harness.engines.vllm.topk`),
                            with ``HARNESS_MOE_SCOPE`` = ``decode`` (default) | ``all``; with SERE,
                            truncation first
``HARNESS_ROUTING_STATS``   ``0`` = the routing op keeps no device counters (benchmarks of the bare op; no
                            SERE canary then); anything else or unset = counters on (what runs need)
========================== ==========================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from harness.techniques.moe_topk import SCOPES

ENV_K = "HARNESS_SERE_K"
ENV_RHO = "HARNESS_SERE_RHO"
ENV_SIMILARITY = "HARNESS_SERE_SIMILARITY"
ENV_PROTECTION = "HARNESS_SERE_PROTECTION"
ENV_PROTECT = "HARNESS_SERE_PROTECT"
ENV_TRACE = "HARNESS_SERE_TRACE"
SERE_ENV = (ENV_K, ENV_RHO, ENV_SIMILARITY, ENV_PROTECTION, ENV_PROTECT, ENV_TRACE)
ENV_VZ_KEEP = "HARNESS_VZ_KEEP"
ENV_VZ_LAYER = "HARNESS_VZ_LAYER"
ENV_VZ_MIN = "HARNESS_VZ_MIN_PER_IMAGE"
ENV_VZ_SCOPE = "HARNESS_VZ_SCOPE"
ENV_VZ_CONTEXTUAL = "HARNESS_VZ_CONTEXTUAL"
ENV_VZ_SPAN_TEXT = "HARNESS_VZ_SPAN_TEXT"
ENV_VZ_METHOD = "HARNESS_VZ_METHOD"  # attention (VisionZip) | random | pool | first (issue 31's baselines)
ENV_VZ_SEED = "HARNESS_VZ_SEED"
VZ_ENV = (ENV_VZ_KEEP, ENV_VZ_LAYER, ENV_VZ_MIN, ENV_VZ_SCOPE, ENV_VZ_CONTEXTUAL, ENV_VZ_SPAN_TEXT, ENV_VZ_METHOD,
          ENV_VZ_SEED)
VZ_ARCH = "HarnessVisionZipQwen3VLMoeForConditionalGeneration"
VZ_REQUEST_ARCH = "HarnessVisionZipRequestQwen3VLMoeForConditionalGeneration"  # scope=request (the bundle)
DEFAULT_SPAN_TEXT = 512
ENV_MOE_TOP_K = "HARNESS_MOE_TOP_K"
ENV_MOE_SCOPE = "HARNESS_MOE_SCOPE"
ENV_MOE_ROUTING = "HARNESS_MOE_ROUTING"  # random_p | top_p: issue 31's routing baselines (vllm.topk)
ENV_MOE_K_PRIMARY = "HARNESS_MOE_K_PRIMARY"
ENV_MOE_P = "HARNESS_MOE_P"
ENV_MOE_SEED = "HARNESS_MOE_SEED"
MOE_ENV = (ENV_MOE_TOP_K, ENV_MOE_SCOPE, ENV_MOE_ROUTING, ENV_MOE_K_PRIMARY, ENV_MOE_P, ENV_MOE_SEED)
ENV_ROUTING_STATS = "HARNESS_ROUTING_STATS"
ALL_ENV = SERE_ENV + VZ_ENV + MOE_ENV + (ENV_ROUTING_STATS,)  # every variable the plugin reads


def routing_stats_enabled(env: dict[str, str] | None = None) -> bool:
    """Whether the routing op keeps its device counters (``HARNESS_ROUTING_STATS``; on unless ``0``)."""
    env = os.environ if env is None else env
    return (env.get(ENV_ROUTING_STATS) or "1").strip() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class SereSettings:
    """SERE settings of this process, read from the environment."""

    k_primary: int
    rho: float
    similarity_path: str
    protection_path: str | None = None
    protect: int | None = None
    trace_path: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "SereSettings | None":
        env = os.environ if env is None else env
        k = (env.get(ENV_K) or "").strip()
        if not k:
            return None
        sim = (env.get(ENV_SIMILARITY) or "").strip()
        if not sim:
            raise RuntimeError(f"{ENV_K}={k} needs {ENV_SIMILARITY} (path of the similarity artifact)")
        protect = (env.get(ENV_PROTECT) or "").strip()
        return cls(
            k_primary=int(k),
            rho=float(env.get(ENV_RHO) or 0.1),
            similarity_path=sim,
            protection_path=(env.get(ENV_PROTECTION) or "").strip() or None,
            protect=int(protect) if protect else None,
            trace_path=(env.get(ENV_TRACE) or "").strip() or None,
        )

    def env(self) -> dict[str, str]:
        """The environment variables that reproduce these settings (what the engine exports)."""
        out = {ENV_K: str(self.k_primary), ENV_RHO: repr(float(self.rho)), ENV_SIMILARITY: self.similarity_path}
        if self.protection_path:
            out[ENV_PROTECTION] = self.protection_path
        if self.protect is not None:
            out[ENV_PROTECT] = str(self.protect)
        if self.trace_path:
            out[ENV_TRACE] = self.trace_path
        return out



@dataclass(frozen=True)
class MoeSettings:
    """``moe.top_k`` settings of this process, read from the environment."""

    top_k: int | None
    scope: str = "decode"
    # issue 31: a routing baseline instead of the truncation (top_k None), harness.techniques.moe_routing
    routing: str | None = None
    k_primary: int = 2
    p: float = 0.5
    seed: int = 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "MoeSettings | None":
        env = os.environ if env is None else env
        k = (env.get(ENV_MOE_TOP_K) or "").strip()
        routing = (env.get(ENV_MOE_ROUTING) or "").strip()
        if routing:
            return cls(top_k=None, routing=routing, k_primary=int(env.get(ENV_MOE_K_PRIMARY) or 2),
                       p=float(env.get(ENV_MOE_P) or 0.5), seed=int(env.get(ENV_MOE_SEED) or 0))
        if not k:
            return None
        scope = (env.get(ENV_MOE_SCOPE) or "decode").strip()
        if int(k) < 1 or scope not in SCOPES:
            raise RuntimeError(f"{ENV_MOE_TOP_K}={k} {ENV_MOE_SCOPE}={scope}: expected K >= 1 and a scope in {SCOPES}")
        return cls(top_k=int(k), scope=scope)

    def env(self) -> dict[str, str]:
        if self.routing:
            return {ENV_MOE_ROUTING: self.routing, ENV_MOE_K_PRIMARY: str(self.k_primary), ENV_MOE_P: repr(self.p),
                    ENV_MOE_SEED: str(self.seed)}
        return {ENV_MOE_TOP_K: str(self.top_k), ENV_MOE_SCOPE: self.scope}


@dataclass(frozen=True)
class VisionZipSettings:
    """VisionZip settings of this process, from the environment. ``scope="image"``: a fixed ratio per
    image (:mod:`harness.engines.vllm.visionzip`, no contextual tokens); ``scope="request"``: one budget
    per request (:mod:`harness.engines.vllm.visionzip_request`, contextual tokens too)."""

    keep: float
    layer: int = -1
    min_per_image: int = 1
    scope: str = "image"
    contextual: float = 0.0
    span_text: int = DEFAULT_SPAN_TEXT
    method: str = "attention"  # random | pool | first: issue 31's baselines (scope=request only)
    seed: int = 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "VisionZipSettings | None":
        env = os.environ if env is None else env
        keep = (env.get(ENV_VZ_KEEP) or "").strip()
        if not keep or float(keep) >= 1.0:
            return None
        scope = (env.get(ENV_VZ_SCOPE) or "image").strip()
        if scope not in ("image", "request"):
            raise RuntimeError(f"{ENV_VZ_SCOPE}={scope!r}: expected image or request")
        min_per_image = int(env.get(ENV_VZ_MIN) or 1)
        if min_per_image < (1 if scope == "image" else 0):  # an empty placeholder run fails vLLM's validation
            raise RuntimeError(f"{ENV_VZ_MIN}={min_per_image}: vLLM needs at least one token per image")
        contextual = float(env.get(ENV_VZ_CONTEXTUAL) or 0.0)
        if contextual > 0 and scope == "image":
            raise RuntimeError(f"{ENV_VZ_CONTEXTUAL}={contextual}: contextual tokens need {ENV_VZ_SCOPE}=request")
        return cls(keep=float(keep), layer=int(env.get(ENV_VZ_LAYER) or -1), min_per_image=min_per_image,
                   scope=scope, contextual=contextual,
                   span_text=int(env.get(ENV_VZ_SPAN_TEXT) or DEFAULT_SPAN_TEXT),
                   method=(env.get(ENV_VZ_METHOD) or "attention").strip(), seed=int(env.get(ENV_VZ_SEED) or 0))

    def env(self) -> dict[str, str]:
        out = {ENV_VZ_KEEP: repr(float(self.keep)), ENV_VZ_LAYER: str(self.layer),
               ENV_VZ_MIN: str(self.min_per_image), ENV_VZ_SCOPE: self.scope}
        if self.scope == "request":
            out.update({ENV_VZ_CONTEXTUAL: repr(float(self.contextual)), ENV_VZ_SPAN_TEXT: str(self.span_text)})
        if self.method != "attention":
            out.update({ENV_VZ_METHOD: self.method, ENV_VZ_SEED: str(self.seed)})
        return out

    @property
    def arch(self) -> str:
        """The architecture the engine selects (``hf_overrides``) and the plugin registers."""
        return VZ_REQUEST_ARCH if self.scope == "request" else VZ_ARCH

    def kept(self, n: int) -> int:
        """Tokens an image of ``n`` LLM tokens keeps: ``select_tokens(..., scope="image")``'s count,
        ``clamp(budget(keep, n), min(min_per_image, n), n)`` — known before the vision tower runs."""
        from harness.techniques.visionzip.pruning import budget

        return min(n, max(min(self.min_per_image, n), budget(self.keep, n)))

    def total(self, sizes) -> int:
        """Visual tokens a request with images of ``sizes`` tokens keeps (``scope`` decides how)."""
        if self.scope == "image":
            return sum(self.kept(int(n)) for n in sizes)
        from harness.techniques.visionzip.bundle import request_total

        return request_total(sizes, self.keep, self.min_per_image)

def describe_env(env: dict[str, str] | None = None) -> dict[str, dict | None]:
    """What these variables switch on, as plain dicts (None = off): how a process — the harness, or a
    ``vllm serve`` reporting through ``harness.engines.vllm.endpoint`` — states its techniques."""
    from dataclasses import asdict

    out: dict[str, dict | None] = {}
    for name, cls in (("sere", SereSettings), ("visionzip", VisionZipSettings), ("moe", MoeSettings)):
        got = cls.from_env(env)
        out[name] = asdict(got) if got is not None else None
    return out
