"""CCBench loader: circular rotations (generated or read), the VLMEvalKit prompt, the real sample, bad inputs."""

from __future__ import annotations

import collections
import re
import csv
import os
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.config.schema import DatasetConfig
from harness.datasets import load_samples
from harness.datasets.base import DatasetError, ImageLoadError
from harness.datasets.ccbench import build_prompt, rotate
from harness.datasets.synthetic.ocr_cc import make_ccbench_sample

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "harness/datasets/bundled/ccbench_sample/CCBench_sample.tsv"
SHARED = Path(os.environ.get("HARNESS_SHARED_DATA") or REPO.parent / "shared/data")  # real upstream rows
REAL = SHARED / "ccbench/CCBench_samples.tsv"


def cfg(**kw) -> DatasetConfig:
    base = dict(name="ccbench", path=str(SAMPLE))
    base.update(kw)
    return DatasetConfig(**base)


def read_rows(path: Path) -> tuple[list[str], list[dict]]:
    csv.field_size_limit(sys.maxsize)
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t")
        return list(reader.fieldnames), list(reader)


def write_rows(path: Path, header: list[str], rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header, delimiter="\t", lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def gold_text(s) -> str:
    return s.reference["options"][s.reference["answer"]]


def check_circular(samples) -> dict[str, list]:
    groups = collections.defaultdict(list)
    for s in samples:
        groups[s.reference["group"]].append(s)
    for rows in groups.values():
        n = rows[0].meta["n_options"]
        assert sorted(s.reference["rotation"] for s in rows) == list(range(n))
        assert len({gold_text(s) for s in rows}) == 1  # the same right option, wherever it moved
        assert len({s.reference["answer"] for s in rows}) == n  # ... and it visits every letter
        assert len({tuple(s.reference["options"].values()) for s in rows}) == n
    return groups


def test_bundled_sample_generates_rotations():
    samples = list(load_samples(cfg()))
    assert len(samples) == 4 * 5 + 3  # six questions, one with three options
    assert len({s.uid for s in samples}) == len(samples)
    groups = check_circular(samples)
    assert list(groups) == [str(i) for i in range(6)]
    assert [s.uid for s in groups["0"]] == ["0", "1000000", "2000000", "3000000"]
    s0 = samples[0]
    assert s0.task == "mcq" and s0.error is None
    assert set(s0.reference) == {"answer", "options", "group", "category", "rotation"}
    assert s0.reference == {"answer": "C", "options": {"A": "一个", "B": "三个", "C": "四个", "D": "两个"},
                            "group": "0", "category": "Count", "rotation": 0}
    assert s0.content == [{"type": "image", "index": 0}, {"type": "text", "text":
                          "Question: 图中有几个图形？\nOptions:\nA. 一个\nB. 三个\nC. 四个\nD. 两个\n请直接回答选项字母。"}]
    r1 = groups["0"][1]
    assert r1.reference["options"] == {"A": "三个", "B": "四个", "C": "两个", "D": "一个"}
    assert r1.reference["answer"] == "B" and r1.meta["rotation"] == 1
    three = groups["4"]
    assert len(three) == 3 and all(list(s.reference["options"]) == ["A", "B", "C"] for s in three)
    assert "看图回答。\n图中" in groups["5"][0].content[1]["text"]  # quoted newline kept
    for s in samples:
        assert s.meta["source"] == "ccbench" and s.meta["category"] == s.reference["category"]
        assert [im.source for im in s.images] == ["ccbench"]
    assert samples[0].load_images()[0].mode == "RGB"


def test_bundled_sample_is_reproducible(tmp_path):
    a = make_ccbench_sample(tmp_path / "a")
    b = make_ccbench_sample(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    strip = lambda rows: [{k: v for k, v in r.items() if k != "image"} for r in rows]  # noqa: E731
    assert strip(read_rows(a)[1]) == strip(read_rows(SAMPLE)[1])


def test_not_circular_and_limit_counts_questions():
    once = list(load_samples(cfg(circular=False)))
    assert [s.uid for s in once] == [str(i) for i in range(6)] and {s.reference["rotation"] for s in once} == {0}
    limited = list(load_samples(cfg(limit=2)))
    assert len(limited) == 8 and {s.reference["group"] for s in limited} == {"0", "1"}


def test_rotation_moves_the_gold_letter():
    opts = {"A": "a", "B": "b", "C": "c", "D": "d"}
    assert rotate(opts, "C", 0) == (opts, "C")
    assert rotate(opts, "C", 1) == ({"A": "b", "B": "c", "C": "d", "D": "a"}, "B")
    assert rotate(opts, "A", 1)[1] == "D"
    assert build_prompt("What?", {"A": "x", "B": "y"}, hint="h") == (
        "Hint: h\nQuestion: What?\nOptions:\nA. x\nB. y\nPlease select the correct answer from the options above.")


@given(st.lists(st.text(min_size=1, max_size=5), min_size=2, max_size=8, unique=True), st.data())
def test_rotations_keep_the_gold_option_and_visit_every_letter(texts, data):
    options = dict(zip("ABCDEFGH", texts))
    gold = data.draw(st.sampled_from(list(options)))
    rotations = [rotate(options, gold, r) for r in range(len(options))]
    assert all(opts[ans] == options[gold] for opts, ans in rotations)
    assert sorted(ans for _, ans in rotations) == sorted(options)
    assert all(sorted(opts.values()) == sorted(texts) and list(opts) == list(options) for opts, _ in rotations)


@pytest.mark.skipif(not REAL.exists(), reason=f"upstream sample {REAL} absent (../shared/data not beside the checkout)")
def test_conformance_real_ccbench_samples():
    samples = list(load_samples(cfg(path=str(REAL))))
    groups = check_circular(samples)
    assert len(groups) == 14 and len(samples) == 56
    assert {s.reference["category"] for s in samples} == {
        "Scenery Building", "Cultural Relic", "Traditional Show", "Calligraphy Painting", "Historical Figure",
        "Sketch Reasoning", "Food Clothes"}
    assert all(s.error is None for s in samples)
    s = groups["0"][0]
    assert s.reference["answer"] == "A" and s.reference["options"]["A"] == "天坛"
    assert s.content[1]["text"].endswith("D. 少林寺\n请直接回答选项字母。")
    assert s.load_images()[0].width > 50


def pre_rotated(tmp_path: Path) -> Path:
    """The bundled file with VLMEvalKit-style rotated rows appended (image field = the main row's index)."""
    header, rows = read_rows(SAMPLE)
    out = []
    for r in rows:
        letters = [k for k in "ABCD" if r[k]]
        opts = {k: r[k] for k in letters}
        for k in range(len(letters)):
            rot, ans = rotate(opts, r["answer"], k)
            row = {**r, **rot, "answer": ans, "index": str(int(r["index"]) + k * 1_000_000)}
            if k:
                row["image"] = r["index"]
            out.append(row)
    out.insert(0, out.pop(1))  # a rotated row before its main row: resolved after the whole file
    path = tmp_path / "CCBench_circular.tsv"
    write_rows(path, header, out)
    return path


def test_file_with_rotated_rows_is_used_as_is(tmp_path):
    path = pre_rotated(tmp_path)
    samples = list(load_samples(cfg(path=str(path))))
    assert len(samples) == 23  # no rotation generated twice
    groups = check_circular(samples)
    assert [s.uid for s in groups["0"]] == ["0", "1000000", "2000000", "3000000"]
    assert all(s.error is None for s in samples)
    assert all(s.images[0].data == groups[g][0].images[0].data for g in groups for s in groups[g])
    assert groups["2"][3].load_images()[0].mode == "RGB"
    once = list(load_samples(cfg(path=str(path), circular=False)))
    assert [s.uid for s in once] == [str(i) for i in range(6)]


def test_bad_images_fail_their_sample_only(tmp_path):
    header, rows = read_rows(SAMPLE)
    rows[0]["image"] = "@@@not base64@@@" * 8
    rows[1]["image"] = ""
    rows[2]["image"] = rows[2]["image"][: len(rows[2]["image"]) // 2 // 4 * 4]  # truncated JPEG
    rows[3]["image"] = "77"  # a reference to an index absent from the file
    path = tmp_path / "bad.tsv"
    write_rows(path, header, rows)
    samples = list(load_samples(cfg(path=str(path))))
    groups = check_circular(samples)
    assert all("invalid base64" in s.error for s in groups["0"])
    assert all("empty image field" in s.error for s in groups["1"])
    assert groups["2"][0].error is None
    with pytest.raises(ImageLoadError):
        groups["2"][0].load_images()
    assert "refers to index 77" in groups["3"][0].error
    assert all(s.error is None for g in ("4", "5") for s in groups[g])


@pytest.mark.parametrize("field,value,reason,message", [
    ("answer", "", "missing_field", r"row 3 \(index=2\): has no field 'answer'"),
    ("question", "", "missing_field", r"row 3 \(index=2\): has no field 'question'"),
    ("answer", "E", "answer_not_an_option", r"row 3 \(index=2\): field 'answer' is 'E'"),
    ("index", "x2", "bad_index", r"row 3 \(index=x2\): field 'index' is 'x2', not an integer"),
])
def test_bad_rows_become_data_errors(tmp_path, field, value, reason, message):
    """One defective row costs its question only (one data-error sample in place of its rotations)."""
    header, rows = read_rows(SAMPLE)
    rows[2][field] = value
    path = tmp_path / "bad.tsv"
    write_rows(path, header, rows)
    samples = list(load_samples(cfg(path=str(path))))
    bad = [s for s in samples if s.error]
    assert len(bad) == 1 and bad[0].error_reason == reason and bad[0].content == []
    assert re.search(rf"bad.tsv:4: {message}", bad[0].error)  # file:line: row n
    good = [s for s in samples if not s.error]
    assert len(good) == len(samples) - 1 and len(check_circular(good)) == 5


def test_missing_column_raises_and_single_option_is_a_row_fault(tmp_path):
    header, rows = read_rows(SAMPLE)
    path = tmp_path / "bad.tsv"
    write_rows(path, [h for h in header if h != "answer"],
               [{k: v for k, v in r.items() if k != "answer"} for r in rows])
    with pytest.raises(DatasetError, match="no column 'answer'.*dataset.path"):
        list(load_samples(cfg(path=str(path))))
    rows[0].update(B="", C="", D="", answer="A")
    write_rows(path, header, rows)
    samples = list(load_samples(cfg(path=str(path))))
    assert samples[0].error_reason == "too_few_options" and "1 option(s)" in samples[0].error
    assert all(s.error is None for s in samples[1:])


def test_split_column_filters(tmp_path):
    header, rows = read_rows(SAMPLE)
    for i, r in enumerate(rows):
        r["split"] = "dev" if i % 2 else "test"
    path = tmp_path / "split.tsv"
    write_rows(path, header + ["split"], rows)
    dev = list(load_samples(cfg(path=str(path), split="dev", circular=False)))
    assert [s.uid for s in dev] == ["1", "3", "5"] and dev[0].meta["split"] == "dev"
