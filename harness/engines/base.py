"""The contract between the run and an inference engine.

An engine takes :class:`Request` objects (chat content + decoded images) and returns one
:class:`Generation` per request, in order, with the timings it measured. Engines never score and never
write files: the run does that, the same way for every engine, which is what makes HF and vLLM results
comparable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Protocol


class TechniqueNotAvailable(RuntimeError):
    """A technique was enabled in the config but is not implemented for this engine yet."""


class EngineUnavailable(RuntimeError):
    """What the chosen engine needs is not in this environment: its package (``engine=vllm`` in a Python without
    vLLM) or the model it must read (a hub id neither cached nor downloadable here, a directory without a
    ``config.json``). Why a class of its own: the CLI says it in one line with exit code 2, like a refused
    configuration, instead of a library's traceback."""


@dataclass
class Request:
    """One prompt: ordered content parts (text / image index) and the decoded images they point to."""

    uid: str
    content: list[dict[str, Any]]
    images: list[Any] = field(default_factory=list)  # PIL images, in the order of the image parts


@dataclass
class Generation:
    """What an engine produced for one request, and how long it took.

    Times are milliseconds from the moment the request's batch started (pre-processing included) —
    TTFT to the first generated token, E2E to the last; ``tpot_ms`` = (E2E − TTFT)/(tokens − 1), None for
    one-token outputs. ``error`` is set (and text empty) when the engine failed on this request.
    """

    uid: str
    text: str = ""
    prompt_tokens: int = 0
    visual_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Engine(Protocol):
    """What the run needs from an engine."""

    name: str

    def generate(self, requests: list[Request]) -> list[Generation]:
        """Greedy generations for ``requests`` (one per request, same order)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Engine name, version, device, dtype: recorded in ``summary.json`` ``run``."""
        ...

    def close(self) -> None:
        """Release the model and its memory."""
        ...


def generate_splitting(batch: list[Request], run: Callable[[list[Request]], list[Generation]],
                       on_failure: Callable[[], None] | None = None) -> list[Generation]:
    """``run(batch)``; when it raises, every request again on its own, so one bad request costs only itself (its
    :class:`Generation` carries the error) — an engine failure is recorded per request, never fatal.
    ``on_failure`` is called for every batch that failed (engines mark their technique statistics partial)."""
    try:
        return run(batch)
    except Exception as e:  # noqa: BLE001 - recorded per request
        if on_failure is not None:
            on_failure()
        if len(batch) == 1:
            return [Generation(uid=batch[0].uid, error=f"{type(e).__name__}: {e}")]
        return [g for r in batch for g in generate_splitting([r], run, on_failure)]
