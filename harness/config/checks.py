"""The vocabulary of harness/run/validate.py's tables: checks on one value (:class:`Check` and its builders), rules
(:class:`Rule`, :class:`CrossRule`), the refusal (:class:`ConfigError`) and the config accessor the rules use.

Kept apart so that each feature's rule block (validate_offload.py, validate_latency.py) can be written with the
same words without importing the tables it is appended to. Standard library only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MISSING = object()


class ConfigError(ValueError):
    """A config value is refused (``python -m harness`` prints the one-line message and exits with code 2)."""


# ------------------------------------------------------------------------------------------------ checks


@dataclass(frozen=True)
class Check:
    """A predicate on one value and the sentence saying what is allowed."""

    ok: Callable[[Any], bool]
    allowed: str | Callable[[], str]  # or computed when a value is refused (registries may grow at run time)

    def text(self) -> str:
        return self.allowed() if callable(self.allowed) else self.allowed


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False,
           integer: bool = False, note: str = "") -> Check:
    """A number in the interval (bounds None = unbounded; ``lo_open``/``hi_open`` exclude the bound)."""

    def ok(v: Any) -> bool:
        if not _is_num(v) or (integer and not isinstance(v, int)):
            return False
        if lo is not None and (v <= lo if lo_open else v < lo):
            return False
        return not (hi is not None and (v >= hi if hi_open else v > hi))

    kind = "an integer" if integer else "a number"
    if lo is not None and hi is not None:
        text = f"{kind} in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        text = f"{kind} {'>' if lo_open else '>='} {lo:g}"
    elif hi is not None:
        text = f"{kind} {'<' if hi_open else '<='} {hi:g}"
    else:
        text = kind
    return Check(ok, text + (f" ({note})" if note else ""))


def at_least(n: int, note: str = "") -> Check:
    return number(n, integer=True, note=note)


def one_of(*choices: Any, note: str = "") -> Check:
    return Check(lambda v: v in choices, "one of " + ", ".join(map(str, choices)) + (f" ({note})" if note else ""))


def optional(check: Check, means: str = "") -> Check:
    """``null`` or what ``check`` allows."""
    return Check(lambda v: v is None or check.ok(v), lambda: f"null{f' ({means})' if means else ''} or {check.text()}")


def registered(registry: dict[str, str]) -> Check:
    """A name of a registry (engines, dataset loaders), read when checked: tests and plugins add entries."""
    return Check(lambda v: v in registry, lambda: "one of " + ", ".join(registry))


def pattern(regex: str, allowed: str) -> Check:
    return Check(lambda v: isinstance(v, str) and re.fullmatch(regex, v) is not None, allowed)


NONEMPTY = Check(lambda v: isinstance(v, str) and v.strip() != "", "a non-empty string")
BOOL = Check(lambda v: isinstance(v, bool), "true or false")


def existing_file(v: Any) -> bool:
    return isinstance(v, str) and Path(v).expanduser().is_file()


# ------------------------------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """``key`` must satisfy ``check`` (when ``when(cfg)`` holds). Inert when the key is absent."""

    key: str
    check: Check
    when: Callable[[Any], bool] | None = None


def _vz_on(cfg: Any) -> bool:
    return _is_num(cfg.visionzip.keep) and cfg.visionzip.keep < 1.0


def _sere_on(cfg: Any) -> bool:
    return cfg.sere.k is not None


def _vllm(cfg: Any) -> bool:
    return cfg.engine.name == "vllm"


@dataclass(frozen=True)
class CrossRule:
    """``key`` is refused when ``applies(cfg)`` holds and ``ok(cfg)`` does not; ``allowed`` says why."""

    key: str
    applies: Callable[[Any], bool]
    ok: Callable[[Any], bool]
    allowed: str | Callable[[Any], str]  # or a function of the config, to name the offending values


@dataclass(frozen=True)
class FileRule:
    """``key`` names a file the run reads: ``problem(path, cfg)`` reads it the way the run will and says what is
    wrong (None: usable); ``model_problem(path, cfg, facts)``, when given, checks it against the numbers the
    checkpoint's ``config.json`` decides (before the weights load). ``what`` says what the file must be. Inert
    when the key is absent or null, or when ``when(cfg)`` does not hold (the run would not read the file)."""

    key: str
    what: str
    problem: Callable[[str, Any], str | None]
    when: Callable[[Any], bool] | None = None
    model_problem: Callable[[str, Any, Any], str | None] | None = None


class StorageError(ConfigError):
    """A directory the run writes (run directory, generation cache, artifact cache) cannot take the write:
    read-only, not ours, full. The one line names the path, the OS's reason and what to do (exit code 2)."""


def _select(cfg: Any, key: str, default: Any = _MISSING) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=default, throw_on_missing=False)
