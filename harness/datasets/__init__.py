"""Dataset loaders, by name (``dataset.name`` in the config).

Targets are ``"module:function"`` strings imported only when chosen (the lm-evaluation-harness pattern),
so a user running OCRBench never imports the RAG-IGBench code and vice versa. A loader takes the dataset
config and the project root and yields :class:`~harness.datasets.base.Sample` objects.

This package lives inside ``harness`` because a top-level ``datasets`` package would shadow Hugging Face's
``datasets`` library.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterator
from pathlib import Path

from harness.datasets.base import DatasetError, ImageInput, Sample

LOADERS: dict[str, str] = {
    "rag_igbench": "harness.datasets.rag_igbench:load",
    "ocrbench": "harness.datasets.ocrbench:load",
    "ccbench": "harness.datasets.ccbench:load",
    "ocr_cc_mix": "harness.datasets.mix:load",
    "synthetic_load": "harness.datasets.synthetic_load:load",  # latency only: exact shapes, no reference
}



def get_loader(name: str):
    """The loader function registered under ``name``; an unknown name suggests the nearest ones."""
    if name not in LOADERS:
        near = difflib.get_close_matches(name, LOADERS, n=3)
        hint = f" Did you mean {', '.join(near)}?" if near else ""
        raise KeyError(f"unknown dataset loader {name!r} (dataset.name).{hint} Known: {sorted(LOADERS)}")
    module, attr = LOADERS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def load_samples(cfg, root: Path | None = None) -> Iterator[Sample]:
    """Samples of the configured dataset; relative paths resolve from ``root`` (default: the working directory,
    see :mod:`harness.config.paths`; bundled samples are named with ``${harness_pkg:...}`` and are absolute)."""
    return get_loader(cfg.name)(cfg, root or Path.cwd())


__all__ = ["DatasetError", "ImageInput", "LOADERS", "Sample", "get_loader", "load_samples"]
