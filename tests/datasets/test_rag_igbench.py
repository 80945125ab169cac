"""RAG-IGBench loader on the bundled sample and on the bad inputs it must survive."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from harness.config.schema import DatasetConfig
from harness.datasets import load_samples
from harness.datasets.base import DatasetError, ImageLoadError, PathEscapeError, resolve_under
from harness.datasets.rag_igbench import url_to_filename

SAMPLE = Path(__file__).resolve().parents[2] / "harness/datasets/bundled/rag_igbench_sample"


def cfg(**kw) -> DatasetConfig:
    base = dict(name="rag_igbench", path=str(SAMPLE / "data.jsonl"))
    base.update(kw)
    return DatasetConfig(**base)


def copy_sample(tmp_path: Path) -> Path:
    dst = tmp_path / "sample"
    shutil.copytree(SAMPLE, dst)
    return dst


def test_bundled_sample_is_small_and_in_the_upstream_format():
    rows = [json.loads(l) for l in (SAMPLE / "data.jsonl").read_text(encoding="utf-8").splitlines()]
    assert 10 <= len(rows) <= 20
    for row in rows:
        assert set(row) == {"id", "query", "documents", "images", "gt_raw_answer", "gt_clean_answer",
                            "category", "split"}
        assert len(row["images"]) == len(row["documents"]) and row["split"] in {"train", "dev"}
        assert json.loads(row["gt_raw_answer"])["answer"] == row["gt_clean_answer"]
    assert sum(f.stat().st_size for f in SAMPLE.rglob("*") if f.is_file()) < 2_000_000
    names = [p.name for p in (SAMPLE / "images").iterdir()]
    assert any("text" in n for n in names) and any("scene" in n for n in names)


def test_samples_number_images_over_all_notes():
    samples = list(load_samples(cfg()))
    assert len(samples) == 12
    s = samples[0]
    n = s.reference["n_candidates"]
    assert n == len(s.images) and n >= 3
    image_parts = [p["index"] for p in s.content if p["type"] == "image"]
    assert image_parts == list(range(n))  # every image once, in IMG#k order
    text = "".join(p.get("text", "") for p in s.content)
    assert all(f"(IMG#{k})" in text for k in range(1, n + 1))
    assert "DOC#1" in text and s.meta["query"] in text
    imgs = s.load_images()
    assert all(im.mode == "RGB" for im in imgs)


def test_split_and_limit():
    assert all(s.meta["split"] == "dev" for s in load_samples(cfg(split="dev")))
    assert len(list(load_samples(cfg(split="train")))) == 3
    assert len(list(load_samples(cfg(limit=2)))) == 2


def test_english_prompt_variant():
    s = next(iter(load_samples(cfg(language="en", limit=1))))
    assert "answer aggregation system" in s.content[0]["text"]


def test_missing_dataset_path_names_the_key(tmp_path):
    with pytest.raises(DatasetError, match="dataset.path") as e:
        list(load_samples(cfg(path=str(tmp_path / "nope.jsonl"))))
    assert "nope.jsonl" in str(e.value)


def test_missing_field_is_a_data_error_naming_file_line_and_field(tmp_path):
    d = copy_sample(tmp_path)
    rows = [json.loads(l) for l in (d / "data.jsonl").read_text(encoding="utf-8").splitlines()]
    del rows[1]["documents"]
    (d / "data.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows), encoding="utf-8")
    samples = list(load_samples(cfg(path=str(d / "data.jsonl"))))
    assert len(samples) == 12 and samples[1].error_reason == "missing_field"
    assert re.search(r"data.jsonl:2 \(id=900002\): has no field 'documents'", samples[1].error)
    assert all(s.error is None for i, s in enumerate(samples) if i != 1)


def test_corrupt_and_missing_images_fail_their_sample_only(tmp_path):
    d = copy_sample(tmp_path)
    samples = list(load_samples(cfg(path=str(d / "data.jsonl"))))
    first, second = samples[0].images[0].path, samples[1].images[0].path
    first.write_bytes(first.read_bytes()[:40])  # truncated PNG
    second.unlink()
    with pytest.raises(ImageLoadError, match="cannot be decoded"):
        samples[0].load_images()
    with pytest.raises(ImageLoadError, match="missing"):
        samples[1].load_images()
    assert samples[2].load_images()


def test_path_escape_is_rejected(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "outside.png").write_bytes(b"x")
    (tmp_path / "root" / "link.png").symlink_to(tmp_path / "outside.png")
    for bad in ("../outside.png", "/etc/passwd", "link.png", "a/../../outside.png"):
        with pytest.raises(PathEscapeError):
            resolve_under(tmp_path / "root", bad)
    assert resolve_under(tmp_path / "root", "sub/x.png") == (tmp_path / "root" / "sub" / "x.png").resolve()


def test_escaping_row_becomes_an_error_sample(tmp_path):
    d = copy_sample(tmp_path)
    rows = [json.loads(l) for l in (d / "data.jsonl").read_text(encoding="utf-8").splitlines()]
    rows[0]["images"][0][0] = "../../etc/passwd"
    (d / "data.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows), encoding="utf-8")
    samples = list(load_samples(cfg(path=str(d / "data.jsonl"))))
    assert "outside" in samples[0].error and samples[0].error_reason == "bad_image_path" and samples[1].error is None


def test_legacy_rows_urls_and_imglist_objects(tmp_path):
    url = "https://sns-img.example.com/abc/1.webp?x=1"
    image = sorted((SAMPLE / "images").glob("*.png"))[0]  # any bundled image
    (tmp_path / url_to_filename(url)).write_bytes(image.read_bytes())
    row = {"id": 7, "query": "q", "documents": ["d1"], "images": [{"imgList": [url]}], "gt_answer": "a ![x](IMG#1)"}
    (tmp_path / "old.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n", encoding="utf-8")
    samples = list(load_samples(cfg(path=str(tmp_path / "old.jsonl"))))
    assert [s.uid for s in samples] == ["7", "7#1"]  # duplicate ids never share a key ...
    assert samples[0].error is None and samples[1].error_reason == "duplicate_id"  # ... and are a data error
    assert samples[0].reference == {"answer": "a ![x](IMG#1)", "n_candidates": 1}
    assert samples[0].images[0].path.name.endswith(".webp") and samples[0].load_images()
