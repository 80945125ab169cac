"""Dataset loaders, by name (``dataset.name`` in the config).

Targets are ``"module:function"`` strings imported only when chosen (the lm-evaluation-harness pattern),
so a user running OCRBench never imports the RAG-IGBench code and vice versa. A loader takes the dataset
config and the project root and yields :class:`~harness.datasets.base.Sample` objects.

This package lives inside ``harness`` because a top-level ``datasets`` package would shadow Hugging Face's
``datasets`` library.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from harness.datasets.base import DatasetError, ImageInput, Sample
from harness.registry import Registry

#: dataset.name → loader ``load(cfg, root) -> Iterator[Sample]``. Adding a dataset is one loader module and one
#: YAML: the module registers itself (``@LOADERS.register("mine")``) or the YAML names it
#: (``dataset.loader: mypkg.mine:load``) — see README, "Add a dataset or a model family".
LOADERS: Registry = Registry("dataset loader", "dataset.name", {
    "rag_igbench": "harness.datasets.rag_igbench:load",
    "ocrbench": "harness.datasets.ocrbench:load",
    "ccbench": "harness.datasets.ccbench:load",
    "ocr_cc_mix": "harness.datasets.mix:load",
    "synthetic_load": "harness.datasets.synthetic_load:load",  # latency only: exact shapes, no reference
})


def get_loader(name: str):
    """The loader function registered under ``name``; an unknown name suggests the nearest ones."""
    return LOADERS.load(name)


def register_from_config(cfg) -> None:
    """``dataset.loader: "pkg.module:load"`` registers that loader under ``dataset.name`` (a dataset outside
    the package needs no edit inside it)."""
    target = getattr(cfg, "loader", None)
    if target:
        LOADERS.register(cfg.name, target)


def load_samples(cfg, root: Path | None = None) -> Iterator[Sample]:
    """Samples of the configured dataset; relative paths resolve from ``root`` (default: the working directory,
    see :mod:`harness.config.paths`; bundled samples are named with ``${harness_pkg:...}`` and are absolute)."""
    register_from_config(cfg)
    return get_loader(cfg.name)(cfg, root or Path.cwd())


__all__ = ["DatasetError", "ImageInput", "LOADERS", "Sample", "get_loader", "load_samples", "register_from_config"]
