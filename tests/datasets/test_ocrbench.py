"""OCRBench loader: bundled sample, the three upstream layouts, the real metadata file, bad inputs."""

from __future__ import annotations

import base64
import collections
import csv
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from harness.config.schema import DatasetConfig
from harness.datasets import load_samples
from harness.datasets.base import DatasetError, ImageLoadError
from harness.datasets.ocrbench import HME_TYPE, hf_row_to_sample
from harness.datasets.synthetic.ocr_cc import make_ocrbench_sample

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "harness/datasets/bundled/ocrbench_sample"
SHARED = Path(os.environ.get("HARNESS_SHARED_DATA") or REPO.parent / "shared/data")  # real upstream rows
REAL = SHARED / "ocrbench/OCRBench.json"


def cfg(**kw) -> DatasetConfig:
    base = dict(name="ocrbench", path=str(SAMPLE / "OCRBench.json"))
    base.update(kw)
    return DatasetConfig(**base)


def copy_sample(tmp_path: Path) -> Path:
    dst = tmp_path / "sample"
    shutil.copytree(SAMPLE, dst)
    return dst


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")


def to_tsv(path: Path, rows: list[list[str]], header=("index", "image", "question", "answer", "category")) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)


def bundled_as_tsv_rows() -> list[list[str]]:
    rows = json.loads((SAMPLE / "OCRBench.json").read_text(encoding="utf-8"))
    out = []
    for i, r in enumerate(rows):
        answers = r["answers"] if isinstance(r["answers"], list) else [r["answers"]]
        b64 = base64.b64encode((SAMPLE / r["image_path"]).read_bytes()).decode()
        out.append([str(i), b64, r["question"], repr(answers), r["type"]])
    return out


# --- bundled sample -------------------------------------------------------------------------------

def test_bundled_sample_loads_with_known_answers():
    samples = list(load_samples(cfg()))
    assert len(samples) == 10
    assert [s.uid for s in samples] == [str(i) for i in range(10)]
    ids = [s.meta["id"] for s in samples]
    assert len(set(ids)) < len(ids)  # a duplicated id, as upstream; the uids stay unique
    types = {s.reference["type"] for s in samples}
    assert {"Regular Text Recognition", "Scene Text-centric VQA", "Doc-oriented VQA",
            "Key Information Extraction", HME_TYPE} <= types
    hme = [s for s in samples if s.reference["type"] == HME_TYPE]
    assert len(hme) == 1 and hme[0].reference["dataset_name"] == "HME100k"
    for s in samples:
        assert s.task == "ocrbench" and s.error is None
        assert s.content[0] == {"type": "image", "index": 0} and s.content[1]["type"] == "text"
        assert isinstance(s.reference["answers"], list) and all(isinstance(a, str) for a in s.reference["answers"])
        assert set(s.reference) == {"answers", "dataset_name", "type"}
        assert s.meta["source"] == "ocrbench" and s.meta["category"] == s.reference["type"]
        assert [im.source for im in s.images] == ["ocrbench"]
        (img,) = s.load_images()
        assert img.mode == "RGB" and img.width >= 40
    assert any(len(s.reference["answers"]) > 1 for s in samples)


def test_bundled_sample_is_reproducible_and_small(tmp_path):
    a = make_ocrbench_sample(tmp_path / "a")
    b = make_ocrbench_sample(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes() == (SAMPLE / "OCRBench.json").read_bytes()
    for f in (tmp_path / "a").rglob("*.png"):
        assert f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes()
    total = sum(f.stat().st_size for d in ("ocrbench_sample", "ccbench_sample")
                for f in (SAMPLE.parent / d).rglob("*") if f.is_file())
    assert total < 300_000


def test_limit():
    assert len(list(load_samples(cfg(limit=3)))) == 3


# --- the real upstream metadata -------------------------------------------------------------------

@pytest.mark.skipif(not REAL.exists(), reason=f"upstream sample {REAL} absent (../shared/data not beside the checkout)")
def test_conformance_real_ocrbench_json(tmp_path):
    (tmp_path / "images").mkdir()  # no images: every sample must be an error sample, not a crash
    samples = list(load_samples(cfg(path=str(REAL), image_root=str(tmp_path / "images"))))
    assert len(samples) == 1000
    assert len({s.uid for s in samples}) == 1000
    assert len({s.meta["id"] for s in samples}) == 857  # upstream ids collide
    types = collections.Counter(s.reference["type"] for s in samples)
    assert types["Scene Text-centric VQA"] == types["Doc-oriented VQA"] == types["Key Information Extraction"] == 200
    assert types[HME_TYPE] == 100
    recognition = ("Regular", "Irregular", "Artistic", "Digit String", "Non-Semantic")
    assert [types[f"{r} Text Recognition" if r != "Digit String" else "Digit String Recognition"]
            for r in recognition] == [50] * 5 and types["Handwriting Recognition"] == 50
    assert all(isinstance(s.reference["answers"], list) and s.reference["answers"] for s in samples)
    raw = json.loads(REAL.read_text(encoding="utf-8"))
    assert sum(isinstance(r["answers"], list) for r in raw) == 149  # 851 strings, 149 lists (one of length 1)
    assert [s.reference["answers"] for s in samples] == [
        r["answers"] if isinstance(r["answers"], list) else [r["answers"]] for r in raw]
    assert {s.reference["dataset_name"] for s in samples if s.reference["type"] == HME_TYPE} == {"HME100k"}
    assert all(s.error and "missing" in s.error for s in samples)
    with pytest.raises(ImageLoadError):
        samples[0].load_images()


# --- bad inputs (JSON layout) ---------------------------------------------------------------------

@pytest.mark.parametrize("field", ["question", "answers", "image_path", "type", "dataset_name", "id"])
def test_missing_field_is_a_data_error_of_its_row(tmp_path, field):
    d = copy_sample(tmp_path)
    rows = json.loads((d / "OCRBench.json").read_text(encoding="utf-8"))
    del rows[3][field]
    write_rows(d / "OCRBench.json", rows)
    samples = list(load_samples(cfg(path=str(d / "OCRBench.json"))))
    assert len(samples) == 10 and samples[3].error_reason == "missing_field"
    assert re.search(rf"OCRBench.json:1: row 3 .*has no field '{field}'", samples[3].error)
    assert all(s.error is None for i, s in enumerate(samples) if i != 3)


@pytest.mark.parametrize("value,reason", [({"a": 1}, "wrong_type"), ([], "empty_field"), ("", "empty_field"),
                                          (42, "wrong_type"), (["ok", 7], "wrong_type"), (None, "missing_field")])
def test_answers_of_a_wrong_type_or_empty_are_data_errors(tmp_path, value, reason):
    d = copy_sample(tmp_path)
    rows = json.loads((d / "OCRBench.json").read_text(encoding="utf-8"))
    rows[0]["answers"] = value
    write_rows(d / "OCRBench.json", rows)
    samples = list(load_samples(cfg(path=str(d / "OCRBench.json"))))
    assert samples[0].error_reason == reason and "row 0 (id=101)" in samples[0].error and "'answers'" in samples[0].error
    assert all(s.error is None for s in samples[1:])


def test_missing_and_truncated_images_fail_their_sample_only(tmp_path):
    d = copy_sample(tmp_path)
    rows = json.loads((d / "OCRBench.json").read_text(encoding="utf-8"))
    (d / rows[0]["image_path"]).unlink()
    trunc = d / rows[1]["image_path"]
    trunc.write_bytes(trunc.read_bytes()[:60])
    samples = list(load_samples(cfg(path=str(d / "OCRBench.json"))))
    assert len(samples) == 10
    assert "missing" in samples[0].error
    assert samples[1].error is None
    with pytest.raises(ImageLoadError, match="cannot be decoded"):
        samples[1].load_images()
    assert all(s.error is None for s in samples[2:]) and samples[2].load_images()


def test_escaping_image_paths_are_rejected(tmp_path):
    d = copy_sample(tmp_path)
    (tmp_path / "secret.png").write_bytes((SAMPLE / "images/SynRegular/001.png").read_bytes())
    (d / "images" / "link.png").symlink_to(tmp_path / "secret.png")
    rows = json.loads((d / "OCRBench.json").read_text(encoding="utf-8"))
    rows[0]["image_path"] = "../secret.png"
    rows[1]["image_path"] = "/etc/passwd"
    rows[2]["image_path"] = "images/link.png"
    write_rows(d / "OCRBench.json", rows)
    samples = list(load_samples(cfg(path=str(d / "OCRBench.json"))))
    for s in samples[:3]:
        assert "rejected image path" in s.error and s.error_reason == "bad_image_path" and s.images == []
    assert all(s.error is None for s in samples[3:])


def test_missing_files_name_the_config_key(tmp_path):
    with pytest.raises(DatasetError, match="dataset.path"):
        list(load_samples(cfg(path=str(tmp_path / "nope.json"))))
    with pytest.raises(DatasetError, match="dataset.image_root"):
        list(load_samples(cfg(image_root=str(tmp_path / "no_images"))))


# --- layout detection -----------------------------------------------------------------------------

def test_folder_and_images_folder_are_detected(tmp_path):
    d = tmp_path / "OCRBench"
    d.mkdir()
    shutil.copy(SAMPLE / "OCRBench.json", d / "OCRBench.json")
    shutil.copytree(SAMPLE / "images", d / "OCRBench_Images" / "images")  # upstream: images in a sibling folder
    samples = list(load_samples(cfg(path=str(d))))
    assert len(samples) == 10 and all(s.error is None for s in samples)
    assert samples[0].images[0].path.is_relative_to(d / "OCRBench_Images")


def test_unknown_extension_needs_a_format_hint(tmp_path):
    f = tmp_path / "ocr.txt"
    to_tsv(f, bundled_as_tsv_rows())
    with pytest.raises(DatasetError, match="dataset.format"):
        list(load_samples(cfg(path=str(f))))
    c = cfg(path=str(f))
    c.format = "tsv"  # the hint a mix source (or a future DatasetConfig field) can give
    assert len(list(load_samples(c))) == 10
    c.format = "xml"
    with pytest.raises(DatasetError, match="unknown OCRBench format"):
        list(load_samples(c))


# --- VLMEvalKit TSV layout ------------------------------------------------------------------------

def test_vlmevalkit_tsv_layout(tmp_path):
    rows = bundled_as_tsv_rows()
    rows[2][2] = "what is\nwritten here?"  # a quoted field with a newline
    rows[3][1] = "not*base64!" * 10  # corrupt base64: an error sample, loading goes on
    rows[4][1] = "0"  # VLMEvalKit: a short image field is the index of the row holding the image
    rows[5][1] = "9"  # ... even one further down the file
    rows[6][3] = "bare answer"  # not a list literal: accepted as one answer
    f = tmp_path / "OCRBench.tsv"
    to_tsv(f, rows)
    samples = {s.uid: s for s in load_samples(cfg(path=str(f)))}
    assert sorted(samples, key=int) == [str(i) for i in range(10)]
    assert samples["2"].content[1]["text"] == "what is\nwritten here?"
    assert "invalid base64" in samples["3"].error
    assert samples["4"].error is None and samples["4"].images[0].data == samples["0"].images[0].data
    assert samples["5"].error is None and samples["5"].images[0].data == samples["9"].images[0].data
    assert samples["6"].reference["answers"] == ["bare answer"]
    assert samples["9"].reference["dataset_name"] == "HME100k"
    assert samples["9"].reference["answers"] == ["x ^ { 2 } + 3 y = 7\n", "x^2 + 3 y = 7\n"]
    assert samples["0"].reference["dataset_name"] == "unknown"
    assert samples["0"].load_images()[0].mode == "RGB"


def test_tsv_missing_column_raises_and_bad_rows_are_data_errors(tmp_path):
    rows = bundled_as_tsv_rows()
    f = tmp_path / "OCRBench.tsv"
    to_tsv(f, [r[:4] for r in rows], header=("index", "image", "question", "answer"))
    with pytest.raises(DatasetError, match="OCRBench.tsv:1: header has no column 'category'.*dataset.path"):
        list(load_samples(cfg(path=str(f))))
    bad = [list(r) for r in rows]
    bad[1][3] = ""
    bad[2][3] = "['unclosed"
    to_tsv(f, bad)
    samples = {s.uid: s for s in load_samples(cfg(path=str(f)))}
    assert samples["1"].error_reason == "missing_field"
    assert re.search(r"OCRBench.tsv:3: row 2 \(index=1\): has no field 'answer'", samples["1"].error)
    assert samples["2"].error_reason == "bad_answer_literal" and "not a Python literal list" in samples["2"].error
    assert len(samples) == 10 and all(samples[str(i)].error is None for i in (0, *range(3, 10)))


def test_tsv_reference_to_an_absent_row_is_an_error_sample(tmp_path):
    rows = bundled_as_tsv_rows()
    rows[0][1] = "424242"
    f = tmp_path / "OCRBench.tsv"
    to_tsv(f, rows)
    samples = {s.uid: s for s in load_samples(cfg(path=str(f)))}
    assert "424242" in samples["0"].error and all(samples[str(i)].error is None for i in range(1, 10))


# --- Hugging Face layout --------------------------------------------------------------------------

def test_hf_layout_without_datasets_says_what_to_install(tmp_path):
    try:  # the `datasets` library is optional (a bare namespace package of that name does not count)
        import datasets

        if hasattr(datasets, "load_dataset"):
            pytest.skip("the Hugging Face `datasets` library is installed here")
    except ImportError:
        pass
    (tmp_path / "test-00000-of-00001.parquet").write_bytes(b"PAR1")
    with pytest.raises(DatasetError, match="pip install datasets"):
        list(load_samples(cfg(path=str(tmp_path))))


def test_hf_rows_convert_like_the_other_layouts():
    png = (SAMPLE / "images/SynRegular/001.png").read_bytes()
    row = {"question": "what is written in the image?", "question_type": "Regular Text Recognition",
           "answer": ["HARBOR"], "image": {"bytes": png, "path": None}, "dataset": "IIIT5K"}
    s = hf_row_to_sample(4, row, "/data/ocrbench", "ocrbench")
    assert s.uid == "4" and s.error is None and s.load_images()[0].mode == "RGB"
    assert s.reference == {"answers": ["HARBOR"], "dataset_name": "IIIT5K", "type": "Regular Text Recognition"}
    from PIL import Image

    s = hf_row_to_sample(5, {**row, "image": Image.new("RGB", (8, 8))}, "/data/ocrbench", "ocrbench")
    assert s.load_images()[0].size == (8, 8)
    assert "missing" in hf_row_to_sample(6, {**row, "image": {"bytes": None, "path": None}}, "x", "ocrbench").error
    bad = hf_row_to_sample(7, {k: v for k, v in row.items() if k != "question_type"}, "x", "ocrbench")
    assert bad.error_reason == "missing_field" and "row 7: has no field 'question_type'" in bad.error
