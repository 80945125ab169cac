"""The OCRBench + CCBench mix: seeded, source-tagged, scored as its targets."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest

from harness.config.schema import DatasetConfig
from harness.datasets import load_samples
from harness.datasets.base import DatasetError

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "harness/datasets/bundled"
OCR = str(BUNDLED / "ocrbench_sample/OCRBench.json")
CC = str(BUNDLED / "ccbench_sample/CCBench_sample.tsv")


def cfg(k: int = 2, n: int | None = 6, seed: int = 0, circular: bool = False, ocr: str = OCR, **kw) -> DatasetConfig:
    sources = {"ocrbench": {"name": "ocrbench", "path": ocr},
               "ccbench": {"name": "ccbench", "path": CC, "circular": circular}}
    return DatasetConfig(name="ocr_cc_mix", n_per_source=n, images_per_request=k, seed=seed, sources=sources, **kw)


def originals() -> dict[str, object]:
    out = {f"ocrbench/{s.uid}": s for s in load_samples(DatasetConfig(name="ocrbench", path=OCR))}
    out.update({f"ccbench/{s.uid}": s for s in load_samples(DatasetConfig(name="ccbench", path=CC))})
    return out


def signature(samples) -> list:
    return [(s.uid, s.meta["target_image"], [im.key for im in s.images], s.meta["context_uids"]) for s in samples]


def test_two_images_per_request_from_both_sources():
    samples = list(load_samples(cfg()))
    orig = originals()
    assert len(samples) == 12
    assert collections.Counter(s.meta["source"] for s in samples) == {"ocrbench": 6, "ccbench": 6}
    for s in samples:
        assert s.dataset == "ocr_cc_mix" and len(s.images) == 2
        assert s.meta["image_sources"] == [im.source for im in s.images]
        assert sorted(s.meta["image_sources"]) == ["ccbench", "ocrbench"]
        t = s.meta["target_image"]
        assert s.meta["image_sources"][t] == s.meta["source"]
        src = orig[s.uid]
        assert s.task == src.task == {"ocrbench": "ocrbench", "ccbench": "mcq"}[s.meta["source"]]
        assert s.reference == src.reference  # scored exactly as the target alone
        assert s.images[t].key == src.images[0].key
        assert s.meta["category"] == src.meta["category"]
        parts = [p["type"] for p in s.content]
        assert parts == ["text", "image", "text", "image", "text"]
        assert s.content[-1]["text"].startswith(f"The question below is about Image {t + 1}.\n")
        assert s.content[-1]["text"].endswith(src.content[1]["text"])
        assert all(c.split("/")[0] != s.meta["source"] for c in s.meta["context_uids"])
        assert s.error is None
        assert [im.mode for im in s.load_images()] == ["RGB", "RGB"]


def test_seeded_determinism():
    a, b = list(load_samples(cfg(seed=3))), list(load_samples(cfg(seed=3)))
    assert signature(a) == signature(b)
    c = list(load_samples(cfg(seed=4)))
    assert signature(a) != signature(c)
    assert {s.uid for s in load_samples(cfg(n=4, seed=3))} != {s.uid for s in load_samples(cfg(n=4, seed=5))}


def test_one_image_per_request_keeps_the_original_samples():
    samples = list(load_samples(cfg(k=1, n=None)))
    orig = originals()
    assert len(samples) == 16
    assert collections.Counter(s.task for s in samples) == {"ocrbench": 10, "mcq": 6}
    for s in samples:
        assert s.content == orig[s.uid].content and s.reference == orig[s.uid].reference
        assert s.meta["image_sources"] == [s.meta["source"]] and s.images[0].source == s.meta["source"]
    assert len(list(load_samples(cfg(k=1, n=None, limit=5)))) == 5


def test_circular_source_keeps_whole_questions_with_one_context():
    samples = list(load_samples(cfg(k=2, n=3, circular=True)))
    cc = [s for s in samples if s.meta["source"] == "ccbench"]
    groups = collections.defaultdict(list)
    for s in cc:
        groups[s.reference["group"]].append(s)
    assert len(groups) == 3
    for rows in groups.values():
        assert sorted(s.reference["rotation"] for s in rows) == list(range(rows[0].meta["n_options"]))
        assert len({(s.meta["target_image"], tuple(s.meta["context_uids"])) for s in rows}) == 1
    assert sum(s.meta["source"] == "ocrbench" for s in samples) == 3


def test_three_images_balance_the_sources():
    samples = list(load_samples(cfg(k=3)))
    for s in samples:
        own = s.meta["image_sources"].count(s.meta["source"])
        assert len(s.images) == 3 and own == 2
        assert len(set(s.meta["context_uids"])) == 2


def test_error_samples_are_never_context(tmp_path):
    d = tmp_path / "ocr"
    shutil.copytree(BUNDLED / "ocrbench_sample", d)
    rows = json.loads((d / "OCRBench.json").read_text(encoding="utf-8"))
    (d / rows[0]["image_path"]).unlink()
    samples = list(load_samples(cfg(n=None, ocr=str(d / "OCRBench.json"))))
    bad = [s for s in samples if s.error]
    assert [s.uid for s in bad] == ["ocrbench/0"] and "missing" in bad[0].error
    assert all("ocrbench/0" not in s.meta["context_uids"] for s in samples)


def test_bad_mix_configs():
    with pytest.raises(DatasetError, match="dataset.sources is empty"):
        list(load_samples(DatasetConfig(name="ocr_cc_mix")))
    nested = DatasetConfig(name="ocr_cc_mix", sources={"m": {"name": "ocr_cc_mix"}})
    with pytest.raises(DatasetError, match="cannot contain a mix"):
        list(load_samples(nested))
    with pytest.raises(DatasetError, match=r"nope/OCRBench.json \(set by dataset.sources.ocrbench.path\)"):
        list(load_samples(DatasetConfig(name="ocr_cc_mix", sources={"ocrbench": {"path": "nope/OCRBench.json"}})))


def test_sample_config_composes_and_loads():
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config.schema import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            c = compose(config_name="config", overrides=["dataset=ocr_cc_mix_sample"])
    finally:
        GlobalHydra.instance().clear()
    samples = list(load_samples(c.dataset))
    assert len(samples) == 12 and all(len(s.images) == 2 for s in samples)
    assert signature(samples) == signature(load_samples(cfg()))
