"""One registry for every named, pluggable part: engines, dataset loaders, task scorers, offload policies.

Why one class: each kind used to keep its own dict of ``"module:attr"`` strings with its own lookup, error text
and extension story, so adding a dataset meant editing three places. A :class:`Registry` is that dict plus
the three things every kind needs (the lm-evaluation-harness ``Registry`` pattern):

- **lazy entries**: a target may be a ``"module:attr"`` string, imported only when the entry is used, so
  choosing OCRBench never imports the RAG-IGBench code and ``import harness.engines`` imports no engine;
- **registration from anywhere**: ``@LOADERS.register("toy")`` on a function in the user's own module, or
  ``LOADERS.register("toy", "mypkg.toy:load")`` — no edit inside ``harness``;
- **one error**: an unknown name names the config key and suggests the nearest registered names.

A registry is a read/write mapping (``name in REG``, ``sorted(REG)``, ``REG[name] = target``), so the
validation vocabulary (:func:`harness.config.checks.registered`) and older code reading it as a dict work
unchanged. Only the standard library is imported here: the registry sits on the bottom floor of the layout.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class UnknownName(KeyError):
    """A name no entry of the registry has; ``str()`` is the whole one-line message."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def resolve_target(target: Any) -> Any:
    """``"package.module:attr"`` → the attribute (imported now); anything else is returned as is."""
    if isinstance(target, str):
        module, sep, attr = target.partition(":")
        if not sep or not module or not attr:
            raise ValueError(f"registry target {target!r} is not of the form 'package.module:attribute'")
        obj: Any = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    return target


class Registry(MutableMapping, Generic[T]):
    """Names → targets (objects, or ``"module:attr"`` strings resolved on first :meth:`load`).

    ``kind`` and ``key`` only shape the error text: ``unknown dataset loader 'x' (dataset.name) ...``.
    """

    def __init__(self, kind: str, key: str, entries: dict[str, Any] | None = None):
        self.kind, self.key = kind, key
        self._targets: dict[str, Any] = dict(entries or {})
        self._resolved: dict[str, T] = {}

    # -- registration
    def register(self, name: str, target: Any = None) -> Any:
        """``register(name, target)`` registers now; ``@register(name)`` registers the decorated object."""
        if target is None:
            def decorate(obj: Any) -> Any:
                self[name] = obj
                return obj
            return decorate
        self[name] = target
        return target

    def __setitem__(self, name: str, target: Any) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} name must be a non-empty string, not {name!r}")
        self._targets[name] = target
        self._resolved.pop(name, None)

    def __delitem__(self, name: str) -> None:
        del self._targets[name]
        self._resolved.pop(name, None)

    # -- lookup
    def __getitem__(self, name: str) -> Any:
        """The registered target as given (a ``"module:attr"`` string stays a string); :meth:`load` resolves."""
        return self._targets[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def unknown(self, name: str) -> UnknownName:
        near = difflib.get_close_matches(str(name), list(self._targets), n=3)
        hint = f" Did you mean {', '.join(near)}?" if near else ""
        return UnknownName(f"unknown {self.kind} {name!r} ({self.key}).{hint} Known: {', '.join(sorted(self))}")

    def load(self, name: str) -> T:
        """The entry's object, imported on first use. An unknown name raises :class:`UnknownName` (a KeyError):
        a registry lookup that silently fell back to a default would run a different experiment."""
        if name not in self._targets:
            raise self.unknown(name)
        if name not in self._resolved:
            self._resolved[name] = resolve_target(self._targets[name])
        return self._resolved[name]

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {sorted(self._targets)})"
