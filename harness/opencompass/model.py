"""An OpenCompass model class that generates with the harness's own HF engine, techniques applied.

Why a model class of ours and not OpenCompass's ``HuggingFacewithChatTemplate``: SERE (``sere.*``) and plain
top-K truncation (``moe.top_k``) are installed by :class:`harness.engines.hf.engine.HFEngine` as router hooks, with
their statistics, and the engine measures TTFT/TPOT per request. Calling that engine is the only way the
accuracy OpenCompass reports belongs to exactly the model whose TPOT the harness reports. (The
OpenAI-compatible route would need a server around the HF engine, which the harness does not have; that
route is the vLLM one, ``vllm serve`` + OpenCompass ``OpenAISDK``.)

OpenCompass builds this class in its inference task (a separate process): it is imported only inside
``.venv-opencompass``. The constructor takes plain dicts (the generated config is a Python file of literals)
and turns them into the attribute objects the engine reads. Every generation's timings are appended to
``trace_path`` (JSONL) and the techniques' statistics are written beside it, so the harness can put TPOT
and the SERE / top-K statistics into ``summary.json`` next to OpenCompass's accuracy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from opencompass.models.base import BaseModel
from opencompass.registry import MODELS

from harness.engines import compat
from harness.engines.base import Request
from harness.engines.hf.engine import HFEngine


def _plain(value: Any) -> Any:
    """mmengine's ``ConfigDict`` / lists as plain containers (OmegaConf refuses ConfigDict)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _node(d: dict[str, Any] | None):
    """A plain dict as the attribute-access config the engine reads (OmegaConf)."""
    if d is None:
        return None
    from omegaconf import OmegaConf

    return OmegaConf.create(_plain(d))


@MODELS.register_module()
class HarnessHFModel(BaseModel):
    """``generate`` = :meth:`HFEngine.generate` on the prompt OpenCompass built, as one user turn.

    The engine applies the model's chat template (as OpenCompass's chat-template HF class does), decodes
    greedily and stops at the model's end-of-sequence tokens or ``max_out_len`` new tokens.
    """

    is_api = False

    def __init__(self, path: str, engine_cfg: dict[str, Any], generation_cfg: dict[str, Any],
                 sere_cfg: dict[str, Any] | None = None, moe_cfg: dict[str, Any] | None = None,
                 visionzip_cfg: dict[str, Any] | None = None, model_id: str | None = None,
                 trust_remote_code: bool = False, trace_path: str | None = None, max_seq_len: int = 4096,
                 meta_template: dict | None = None, **kwargs: Any):
        super().__init__(path=path, max_seq_len=max_seq_len, meta_template=meta_template)

        compat.install()  # .venv-opencompass has torch 2.13.0+cpu and no torchvision, as the vLLM lane

        self.engine = HFEngine(path, _node(engine_cfg), _node(generation_cfg), trust_remote_code=trust_remote_code,
                               sere_cfg=_node(sere_cfg), visionzip_cfg=_node(visionzip_cfg),
                               moe_cfg=_node(moe_cfg), model_id=model_id)
        self.tokenizer = self.engine.processor.tokenizer
        self.trace_path = Path(trace_path) if trace_path else None
        self._n = 0
        self._warm = False

    def generate(self, inputs: list[str], max_out_len: int, **kwargs: Any) -> list[str]:
        """Greedy answers, in order; an engine failure on one prompt is that prompt's empty answer, recorded
        with its error in the trace (OpenCompass then scores it wrong, as it scores any empty answer)."""
        requests = []
        for text in inputs:
            requests.append(Request(uid=f"oc-{os.getpid()}-{self._n}", content=[{"type": "text", "text": str(text)}]))
            self._n += 1
        if not self._warm and requests and self.engine.cfg.warmup:  # first-call set-up stays out of TTFT
            self.engine.warmup(requests[: max(1, self.engine.cfg.batch_size)])
            self._warm = True
        self.engine.gen_cfg.max_new_tokens = int(max_out_len)
        gens = self.engine.generate(requests)
        self._trace(inputs, gens)
        return [g.text if not g.error else "" for g in gens]

    def _trace(self, inputs: list[str], gens: list[Any]) -> None:
        if self.trace_path is None:
            return
        self.trace_path.parent.mkdir(parents=True, exist_ok=True)
        with self.trace_path.open("a", encoding="utf-8") as f:
            for text, g in zip(inputs, gens):
                f.write(json.dumps({"uid": g.uid, "prompt": str(text), "answer": g.text, "error": g.error,
                                    "prompt_tokens": g.prompt_tokens, "output_tokens": g.output_tokens,
                                    "ttft_ms": g.ttft_ms, "tpot_ms": g.tpot_ms, "e2e_ms": g.e2e_ms,
                                    "batch_size": g.extra.get("batch_size")}, ensure_ascii=False) + "\n")
        stats = self.engine.technique_stats()
        stats["engine"] = self.engine.describe()
        # one file per process: OpenCompass may run several inference tasks, each with its own engine
        final = self.trace_path.with_name(f"{self.trace_path.stem}.stats.{os.getpid()}.json")
        tmp = final.with_suffix(".tmp")
        tmp.write_text(json.dumps(stats, ensure_ascii=False, default=str), encoding="utf-8")
        tmp.replace(final)

    def get_token_len(self, prompt: str) -> int:
        return len(self.tokenizer.encode(str(prompt)))

    def get_ppl(self, inputs: list[str], mask_length: list[int] | None = None) -> list[float]:
        """Perplexity-style (``ppl``) dataset configs are not supported: SERE and ``moe.top_k`` act on decode
        steps, which a likelihood pass never takes, so the ``gen`` configs are the ones that measure them."""
        raise NotImplementedError("HarnessHFModel evaluates generation (gen) dataset configs only; "
                                  "pick the *_gen variant of the dataset")
