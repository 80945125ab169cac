"""A seeded mix of several datasets (``dataset=ocr_cc_mix``): OCRBench and CCBench images in one pool.

Why: VisionZip's shared budget (``visionzip.scope=request``) lets text-dense images (OCRBench) and plain
photos (CCBench) compete for visual tokens; the figure of merit is each source's keep rate beside each
source's accuracy. Every image carries its source tag (``ImageInput.source``).

Config: ``sources`` maps a source tag to that source's dataset settings (``name`` = its loader, default the
tag; ``path``, ``image_root``, ``circular``, ``limit``, ``format``, ...); ``n_per_source`` draws that many
units from each source (all when null) with ``random.Random(seed)``; a *unit* is one sample, or for a
multiple-choice source one question with all its rotations, so circular scoring stays complete. The units
of all sources are then shuffled (seeded) and ``limit`` keeps the first ``limit`` units.

``images_per_request == 1``: the drawn samples themselves, ``task``, ``content`` and ``reference``
unchanged, ``uid = "<source>/<uid>"``.

``images_per_request = k > 1``: every drawn sample is the *target* of exactly one request (so each source's
accuracy is over the same samples as with k = 1). The request shows k images — the target's and k − 1
*context* images drawn from the other drawn samples, the sources balanced (ceil(k/2) of the target's
source counting the target, the rest from the others, in turn), at seeded positions — each image preceded
by ``Image i:``, then ``The question below is about Image t.`` and the target's own text (its benchmark
prompt, unchanged). The request is scored exactly as the target alone: ``task``/``reference`` are the
target's. The context images only compete for the visual budget. All rotations of a CCBench question get
the same context images at the same positions (drawn from a generator seeded by seed, source and group),
so only the option order differs between them. Samples whose image failed at load time (``error``) are
never used as context; a target with an error gives an error request.

``meta`` of a mix sample: the target's meta plus ``source`` (target's tag), ``image_sources`` (the tag of
every image in order), ``target_image`` (0-based position), ``context_uids`` and ``source_dataset``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

from harness.datasets import get_loader
from harness.datasets._io import cfg_get
from harness.datasets.base import DatasetError, Sample

MIX_LOADERS = {"ocr_cc_mix"}


def _plain(value: Any) -> Any:
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    return value


def source_config(tag: str, settings: Any, seed: int):
    """A :class:`DatasetConfig` for one source (unknown keys such as ``format`` kept as attributes)."""
    from harness.config.schema import DatasetConfig

    settings = _plain(settings)
    if settings is not None and not isinstance(settings, dict):
        raise DatasetError(f"dataset.sources.{tag} must be a mapping of that source's settings "
                           f"(name, path, ...), got {settings!r}")
    settings = dict(settings or {})
    settings.setdefault("name", tag)
    settings.setdefault("seed", seed)
    known = {f.name for f in fields(DatasetConfig)}
    cfg = DatasetConfig(**{k: v for k, v in settings.items() if k in known})
    for k, v in settings.items():
        if k not in known:
            setattr(cfg, k, v)
    cfg.config_key = f"dataset.sources.{tag}"  # so the source's file errors name the key the user sets
    return cfg


def _unit_key(sample: Sample) -> str:
    return str(sample.reference.get("group", sample.uid)) if sample.task == "mcq" else sample.uid


def load_source(tag: str, settings: Any, seed: int, root: Path) -> list[list[Sample]]:
    """The units (lists of samples sharing a question) of one source, retagged with ``tag``."""
    cfg = source_config(tag, settings, seed)
    if cfg.name in MIX_LOADERS:
        raise DatasetError(f"dataset.sources.{tag}: a mix cannot contain a mix ({cfg.name!r})")
    units: dict[str, list[Sample]] = {}
    for s in get_loader(cfg.name)(cfg, root):
        for img in s.images:
            img.source = tag
        s.meta = {**s.meta, "source": tag}
        units.setdefault(_unit_key(s), []).append(s)
    if not units:
        raise DatasetError(f"dataset.sources.{tag}: source produced no samples (check its path, split, limit)")
    return list(units.values())


def _context_plan(k: int, target_tag: str, tags: list[str]) -> list[str]:
    """Source tags of the k − 1 context images: the target's source gets ceil(k/2) − 1, others in turn."""
    others = [t for t in tags if t != target_tag] or [target_tag]
    own = math.ceil(k / 2) - 1
    plan = [target_tag] * own
    i = 0
    while len(plan) < k - 1:
        plan.append(others[i % len(others)])
        i += 1
    return plan


def _compose(target: Sample, context: list[Sample], position: int, dataset: str, tag: str) -> Sample:
    if target.error_reason and not target.images:  # a defective row: nothing to show, it stays an error
        return _compose_single(target, dataset, tag)
    others = [img for s in context for img in s.images[:1]]
    images = others[:position] + target.images[:1] + others[position:]
    content: list[dict] = []
    for i in range(len(images)):
        content.append({"type": "text", "text": f"Image {i + 1}:"})
        content.append({"type": "image", "index": i})
    text = "\n".join(p["text"] for p in target.content if p["type"] == "text")
    content.append({"type": "text", "text": f"The question below is about Image {position + 1}.\n{text}"})
    meta = {
        **target.meta,
        "source": tag,
        "source_dataset": target.dataset,
        "image_sources": [img.source for img in images],
        "target_image": position,
        "context_uids": [f"{s.meta['source']}/{s.uid}" for s in context],
    }
    return Sample(uid=f"{tag}/{target.uid}", dataset=dataset, task=target.task, content=content, images=images,
                  reference=target.reference, meta=meta, error=target.error, error_reason=target.error_reason)


def load(cfg, root: Path) -> Iterator[Sample]:
    """The mixed requests (see the module docstring), deterministic for a given ``seed``."""
    sources = _plain(cfg_get(cfg, "sources")) or {}
    if not isinstance(sources, dict):
        raise DatasetError(f"dataset.sources must map source tags to their settings, got {sources!r}")
    if len(sources) < 1:
        raise DatasetError("dataset.sources is empty: give each source's settings, e.g. "
                           "{ocrbench: {name: ocrbench, path: ...}, ccbench: {name: ccbench, path: ...}}")
    seed = int(cfg_get(cfg, "seed", 0))
    n = cfg_get(cfg, "n_per_source")
    k = int(cfg_get(cfg, "images_per_request", 1))
    if k < 1:
        raise DatasetError(f"dataset.images_per_request must be ≥ 1, got {k}")
    dataset = cfg_get(cfg, "name", "ocr_cc_mix")
    rng = random.Random(seed)
    tags = list(sources)
    drawn: dict[str, list[list[Sample]]] = {}
    for tag in tags:
        units = load_source(tag, sources[tag], seed, root)
        if n is not None and n < len(units):
            picks = sorted(rng.sample(range(len(units)), n))
            units = [units[i] for i in picks]
        drawn[tag] = units

    requests: list[list[Sample]] = []  # one list per unit: a question's rotations stay together
    if k == 1:
        for tag in tags:
            for unit in drawn[tag]:
                requests.append([_compose_single(s, dataset, tag) for s in unit])
    else:
        pool = {tag: [u[0] for u in drawn[tag] if u[0].error is None and u[0].images] for tag in tags}
        for tag in tags:
            for unit in drawn[tag]:
                unit_rng = random.Random(f"{seed}:{tag}:{_unit_key(unit[0])}")
                context: list[Sample] = []
                for ctx_tag in _context_plan(k, tag, tags):
                    taken = {id(c) for c in context}
                    cands = [c for c in pool[ctx_tag]
                             if _unit_key(c) != _unit_key(unit[0]) or ctx_tag != tag]
                    cands = [c for c in cands if id(c) not in taken] or cands
                    if not cands:
                        raise DatasetError(f"source {ctx_tag!r} has no usable image to fill a "
                                           f"{k}-image request (dataset.n_per_source too small?)")
                    context.append(unit_rng.choice(cands))
                position = unit_rng.randrange(k)
                requests.append([_compose(s, context, position, dataset, tag) for s in unit])
    rng.shuffle(requests)
    limit = cfg_get(cfg, "limit")  # counts units (questions), like the CCBench loader
    for unit in requests if limit is None else requests[:limit]:
        yield from unit


def _compose_single(s: Sample, dataset: str, tag: str) -> Sample:
    meta = {**s.meta, "source": tag, "source_dataset": s.dataset, "image_sources": [img.source for img in s.images],
            "target_image": 0, "context_uids": []}
    return Sample(uid=f"{tag}/{s.uid}", dataset=dataset, task=s.task, content=s.content, images=s.images,
                  reference=s.reference, meta=meta, error=s.error, error_reason=s.error_reason)
