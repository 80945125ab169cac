"""A corpus of defective data files, one per fault, each with the outcome it must have (issue 12, item 4).

File faults (the file cannot be read as its format) stop the run with ONE :class:`DatasetError` line naming
the file, the line where there is one, and the config key that points at the file (exit 2 in the CLI).
Row faults never stop the run: the row becomes a data-error sample with a reason code (scored 0, counted in
``metrics.data_errors``) and every other row loads as usual. The files are generated here, in ``tmp_path``;
the builders use only the standard library and PIL, so ``CASES`` can also be replayed against older code
(how the closing note's "before" column was measured).
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from harness.config.schema import DatasetConfig
from harness.datasets import load_samples
from harness.datasets.base import DatasetError

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------- builders

def png(color: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), color).save(buf, format="PNG")
    return buf.getvalue()


def write_images(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        (folder / name).write_bytes(png((40 * i % 256, 90, 160)))


def rag_rows() -> list[dict]:
    """Three valid RAG-IGBench rows (current schema), two notes each, images under img/."""
    rows = []
    for i in (1, 2, 3):
        rows.append({
            "id": 100 + i, "query": f"问题{i}怎么做？", "documents": [f"笔记{i}甲的内容。", f"笔记{i}乙的内容。"],
            "images": [[f"img/{i}a.png"], [f"img/{i}b.png"]],
            "gt_raw_answer": "{}", "gt_clean_answer": "先这样做<sup>[1](DOC#1)</sup>。![图](IMG#1)然后那样做。![图](IMG#2)",
            "category": ["生活", "how-to"], "split": "dev",
        })
    return rows


def rag(tmp: Path, mutate: Callable[[list], None] | None = None, *, raw: bytes | None = None,
        name: str = "data.jsonl") -> tuple[DatasetConfig, Path]:
    write_images(tmp / "img", [f"{i}{n}.png" for i in (1, 2, 3) for n in "ab"])
    path = tmp / name
    if raw is None:
        rows = rag_rows()
        if mutate:
            mutate(rows)
        raw = "\n".join(json.dumps(r, ensure_ascii=False) for r in rows).encode("utf-8") + b"\n"
    path.write_bytes(raw)
    return DatasetConfig(name="rag_igbench", path=str(path)), path


def ocr_rows() -> list[dict]:
    return [{"dataset_name": "IIIT5K", "id": 7 + i, "image_path": f"img/{i}.png", "question": "what is written?",
             "answers": ["WORD", "word"] if i == 1 else "WORD", "type": "Regular Text Recognition"} for i in range(3)]


def ocr_json(tmp: Path, mutate: Callable[[list], None] | None = None, *, raw: bytes | None = None
             ) -> tuple[DatasetConfig, Path]:
    write_images(tmp / "img", [f"{i}.png" for i in range(3)])
    path = tmp / "OCRBench.json"
    if raw is None:
        rows = ocr_rows()
        if mutate:
            mutate(rows)
        raw = json.dumps(rows, ensure_ascii=False, indent=1).encode("utf-8")
    path.write_bytes(raw)
    return DatasetConfig(name="ocrbench", path=str(path), image_root=str(tmp)), path


def b64(i: int) -> str:
    return base64.b64encode(png((10 * i, 200, 30))).decode()


OCR_TSV_HEADER = ["index", "image", "question", "answer", "category"]


def ocr_tsv(tmp: Path, mutate: Callable[[list], None] | None = None, *, raw: bytes | None = None
            ) -> tuple[DatasetConfig, Path]:
    path = tmp / "OCRBench.tsv"
    if raw is None:
        lines = [list(OCR_TSV_HEADER)] + [[str(i), b64(i), "what is written?", "['WORD']", "Regular Text Recognition"]
                                    for i in range(3)]
        if mutate:
            mutate(lines)
        raw = "".join("\t".join(line) + "\n" for line in lines).encode("utf-8")
    path.write_bytes(raw)
    return DatasetConfig(name="ocrbench", path=str(path)), path


CC_HEADER = ["index", "question", "A", "B", "C", "D", "answer", "category", "image"]


def cc_lines() -> list[list[str]]:
    return [list(CC_HEADER)] + [[str(i), f"图中是哪座建筑{i}？", "天坛", "故宫", "黄鹤楼", "", "B", "Scenery Building", b64(i)]
                          for i in range(3)]


def cc_tsv(tmp: Path, mutate: Callable[[list], None] | None = None, *, raw: bytes | None = None,
           name: str = "CCBench.tsv") -> tuple[DatasetConfig, Path]:
    path = tmp / name
    if raw is None:
        lines = cc_lines()
        if mutate:
            mutate(lines)
        raw = "".join("\t".join(line) + "\n" for line in lines).encode("utf-8")
    path.write_bytes(raw)
    return DatasetConfig(name="ccbench", path=str(path)), path


def mix(tmp: Path, cc_mutate: Callable[[list], None] | None = None) -> tuple[DatasetConfig, Path]:
    """An OCRBench JSON source and a CCBench TSV source (asked once per question), one image per request."""
    _, ocr_path = ocr_json(tmp / "ocr")
    (tmp / "cc").mkdir()
    _, cc_path = cc_tsv(tmp / "cc", cc_mutate)
    sources = {"ocrbench": {"name": "ocrbench", "path": str(ocr_path), "image_root": str(tmp / "ocr")},
               "ccbench": {"name": "ccbench", "path": str(cc_path), "circular": False}}
    return DatasetConfig(name="ocr_cc_mix", sources=sources, n_per_source=None, images_per_request=1), cc_path


def set_(index: int, key: str, value: Any) -> Callable[[list], None]:
    def apply(rows: list) -> None:
        rows[index][key] = value
    return apply


def delete(index: int, key: str) -> Callable[[list], None]:
    def apply(rows: list) -> None:
        del rows[index][key]
    return apply


def cell(line: int, column: str, value: str, header: list[str]) -> Callable[[list], None]:
    def apply(lines: list) -> None:
        lines[line][header.index(column)] = value
    return apply


# ----------------------------------------------------------------------------------------------- cases

@dataclass
class FileFault:
    """The whole file is refused: one DatasetError line naming the file, ``line`` (if any) and ``key``."""

    key: str
    line: int | None = None
    says: str = ""  # a phrase the message must contain


@dataclass
class RowFaults:
    """The file loads: ``bad`` maps a sample uid to its reason; every other sample has no error."""

    bad: dict[str, str]
    n_samples: int
    says: str = ""  # a phrase the bad rows' message must contain
    check: Callable[[list], None] | None = None


@dataclass
class Case:
    id: str
    fault: str  # what is wrong with the file (the closing note's table)
    build: Callable[[Path], tuple[DatasetConfig, Path]]
    expect: FileFault | RowFaults
    issue: str = ""  # how the issue saw it fail before: stop | traceback | silent | unclassified
    extra: dict = field(default_factory=dict)


def _directory(tmp: Path):
    cfg, path = rag(tmp)
    folder = tmp / "folder.jsonl"
    folder.mkdir()
    cfg.path = str(folder)
    return cfg, folder


def _nul_path(loader: Callable[[Path], tuple[DatasetConfig, Path]]):
    def build(tmp: Path):
        cfg, path = loader(tmp)
        cfg.path = str(path.parent / ("bad\x00" + path.name))
        return cfg, Path("bad")  # the message shows the path as repr: match on the visible prefix
    return build


def with_split(build: Callable[[Path], tuple[DatasetConfig, Path]], split: str):
    def apply(tmp: Path):
        cfg, path = build(tmp)
        cfg.split = split
        return cfg, path
    return apply


def _image_root_is_file(tmp: Path):
    cfg, path = rag(tmp)
    cfg.image_root = str(path)
    return cfg, path


def _mix_missing_source_file(tmp: Path):
    cfg, path = mix(tmp)
    cfg.sources["ccbench"]["path"] = str(tmp / "gone" / "CCBench.tsv")
    return cfg, tmp / "gone" / "CCBench.tsv"


def _mix_missing_image_root(tmp: Path):
    cfg, path = mix(tmp)
    cfg.sources["ocrbench"]["image_root"] = str(tmp / "no_images")
    return cfg, tmp / "no_images"


def _mix_source_not_a_mapping(tmp: Path):
    cfg, path = mix(tmp)
    cfg.sources["ccbench"] = str(path)
    return cfg, Path("ccbench")


def _mix_source_folder_without_tsv(tmp: Path):
    cfg, path = mix(tmp)
    empty = tmp / "empty_folder"
    empty.mkdir()
    cfg.sources["ocrbench"]["path"] = str(empty)
    return cfg, empty


def _rag_missing_image_file(tmp: Path):
    cfg, path = rag(tmp)
    (tmp / "img" / "2b.png").unlink()
    return cfg, path


def _ocr_missing_image_file(tmp: Path):
    cfg, path = ocr_json(tmp)
    (tmp / "img" / "1.png").unlink()
    return cfg, path


UTF16 = "\ufeff".encode("utf-16-le") + json.dumps(rag_rows()[0], ensure_ascii=False).encode("utf-16-le")
GBK_TSV = ("\t".join(CC_HEADER) + "\n" + "\t".join(["0", "图中是哪座建筑？", "天坛", "故宫", "", "", "A", "x", b64(0)])
           + "\n").encode("gbk")

CASES: list[Case] = [
    # --- file faults: RAG-IGBench ------------------------------------------------------------------
    Case("rag-folder", "dataset.path is a folder", _directory, FileFault("dataset.path", says="is a folder"),
         "traceback"),
    Case("rag-non-utf8", "a Latin-1 byte (0xe9) on line 2", lambda t: rag(t, raw=(
        json.dumps(rag_rows()[0]).encode() + b'\n{"id": 102, "query": "caf\xe9"}\n')),
         FileFault("dataset.path", 2, "not UTF-8"), "traceback"),
    Case("rag-utf16", "the file is UTF-16 (with BOM)", lambda t: rag(t, raw=UTF16),
         FileFault("dataset.path", 1, "not UTF-8"), "traceback"),
    Case("rag-empty", "an empty file (0 bytes)", lambda t: rag(t, raw=b""), FileFault("dataset.path", says="empty"),
         "traceback"),
    Case("rag-blank", "only blank lines", lambda t: rag(t, raw=b"\n  \n\n"), FileFault("dataset.path", says="empty"),
         "traceback"),
    Case("rag-empty-array", "a JSON array with no rows: []", lambda t: rag(t, raw=b"[]\n"),
         FileFault("dataset.path", says="no rows"), "traceback"),
    Case("rag-not-json", "a TSV given as the JSON Lines file", lambda t: rag(t, raw=b"id\tquery\n1\tq\n"),
         FileFault("dataset.path", 1, "not valid JSON"), "stop"),
    Case("rag-truncated", "the last line cut mid-row (interrupted download)", lambda t: rag(t, raw=(
        json.dumps(rag_rows()[0]) + "\n" + json.dumps(rag_rows()[1]) + "\n" + json.dumps(rag_rows()[2])[:40]
    ).encode()), FileFault("dataset.path", 3, "not valid JSON"), "stop"),
    Case("rag-array-syntax", "a JSON array missing the comma after row 2 (error on line 4)", lambda t: rag(t, raw=(
        "[\n" + json.dumps(rag_rows()[0]) + ",\n" + json.dumps(rag_rows()[1]) + "\n" + json.dumps(rag_rows()[2])
        + "\n]").encode()), FileFault("dataset.path", 4, "not valid JSON"), "stop"),
    Case("rag-pretty-object", "one pretty-printed JSON object (neither JSON Lines nor an array)",
         lambda t: rag(t, raw=json.dumps(rag_rows()[0], indent=2).encode()),
         FileFault("dataset.path", 1, "one JSON object per line"), "stop"),
    Case("rag-nul-path", "a NUL byte in dataset.path", _nul_path(rag), FileFault("dataset.path", says="NUL"),
         "traceback"),
    Case("rag-split-absent", "dataset.split=test, the file has only dev rows", with_split(rag, "test"),
         FileFault("dataset.split", says="'dev'"), "traceback"),
    Case("rag-image-root-file", "dataset.image_root names a file", _image_root_is_file,
         FileFault("dataset.image_root", says="is a file"), "stop"),
    # --- file faults: OCRBench ----------------------------------------------------------------------
    Case("ocr-json-non-utf8", "OCRBench.json with a GBK-encoded question on line 6", lambda t: ocr_json(t, raw=(
        json.dumps(ocr_rows(), ensure_ascii=False, indent=1).replace("what is written?", "写的是什么", 1)
    ).encode("gbk")), FileFault("dataset.path", 6, "not UTF-8"), "traceback"),
    Case("ocr-json-empty", "an empty OCRBench.json", lambda t: ocr_json(t, raw=b""),
         FileFault("dataset.path", says="empty"), "traceback"),
    Case("ocr-tsv-missing-column", "OCRBench.tsv without the 'category' column", lambda t: ocr_tsv(
        t, lambda lines: [line.pop() for line in lines]), FileFault("dataset.path", 1, "no column 'category'"),
         "stop"),
    Case("ocr-tsv-header-only", "OCRBench.tsv with a header and no rows", lambda t: ocr_tsv(
        t, raw=("\t".join(OCR_TSV_HEADER) + "\n").encode()), FileFault("dataset.path", says="no data rows"),
         "traceback"),
    Case("ocr-tsv-comma-separated", "a comma-separated file named .tsv", lambda t: ocr_tsv(
        t, raw=b"index,image,question,answer,category\n0,xx,q,['a'],t\n"),
         FileFault("dataset.path", 1, "tab-separated"), "stop"),
    # --- file faults: CCBench -----------------------------------------------------------------------
    Case("cc-empty", "an empty CCBench.tsv", lambda t: cc_tsv(t, raw=b""), FileFault("dataset.path", says="empty"),
         "stop"),
    Case("cc-json-not-tsv", "a JSON file given as the TSV", lambda t: cc_tsv(t, raw=json.dumps(ocr_rows()).encode()),
         FileFault("dataset.path", 1, "no column"), "stop"),
    Case("cc-gbk", "CCBench.tsv saved as GBK (first Chinese on line 2)", lambda t: cc_tsv(t, raw=GBK_TSV),
         FileFault("dataset.path", 2, "not UTF-8"), "traceback"),
    Case("cc-nul-path", "a NUL byte in dataset.path", _nul_path(cc_tsv), FileFault("dataset.path", says="NUL"),
         "traceback"),
    Case("cc-split-absent", "dataset.split=dev, the file's rows are all 'test'", with_split(lambda t: cc_tsv(
        t, lambda lines: [line.append("split" if i == 0 else "test") for i, line in enumerate(lines)]), "dev"),
         FileFault("dataset.split", says="'test'"), "traceback"),
    # --- file faults: the OCR+CC mix (the key is the source's) -------------------------------------
    Case("mix-missing-source", "a source's file does not exist", _mix_missing_source_file,
         FileFault("dataset.sources.ccbench.path", says="not found"), "stop"),
    Case("mix-missing-image-root", "a source's image root does not exist", _mix_missing_image_root,
         FileFault("dataset.sources.ocrbench.image_root", says="not found"), "stop"),
    Case("mix-source-not-mapping", "a source given as a bare path instead of its settings", _mix_source_not_a_mapping,
         FileFault("dataset.sources.ccbench", says="must be a mapping"), "traceback"),
    Case("mix-source-empty-folder", "a source's path is a folder without data files", _mix_source_folder_without_tsv,
         FileFault("dataset.sources.ocrbench.path", says="no OCRBench.json"), "stop"),

    # --- row faults: RAG-IGBench -------------------------------------------------------------------
    Case("rag-documents-null", "documents: null", lambda t: rag(t, set_(1, "documents", None)),
         RowFaults({"102": "missing_field"}, 3, "'documents' is null"), "traceback"),
    Case("rag-documents-string", "documents given as one string", lambda t: rag(t, set_(1, "documents", "一段笔记")),
         RowFaults({"102": "wrong_type"}, 3, "'documents' must be a list"), "silent"),
    Case("rag-3-docs-2-image-lists", "3 documents with only 2 image lists", lambda t: rag(
        t, set_(1, "documents", ["甲", "乙", "丙"])), RowFaults({"102": "documents_images_mismatch"}, 3,
                                                           "3 documents but 2 image lists"), "silent"),
    Case("rag-query-null", "query: null", lambda t: rag(t, set_(0, "query", None)),
         RowFaults({"101": "missing_field"}, 3, "'query' is null"), "silent"),
    Case("rag-query-number", "query given as a number", lambda t: rag(t, set_(0, "query", 42)),
         RowFaults({"101": "wrong_type"}, 3, "'query' must be a string"), "silent"),
    Case("rag-missing-id", "a row without 'id' (line 2)", lambda t: rag(t, delete(1, "id")),
         RowFaults({"line2": "missing_field"}, 3, "has no field 'id'"), "stop"),
    Case("rag-id-list", "id given as a list", lambda t: rag(t, set_(1, "id", [102])),
         RowFaults({"line2": "wrong_type"}, 3, "'id' must be an integer or a string"), "silent"),
    Case("rag-duplicate-id", "two rows with id 101", lambda t: rag(t, set_(1, "id", 101)),
         RowFaults({"101#1": "duplicate_id"}, 3, "used by an earlier row"), "silent"),
    Case("rag-image-escape", "an image path ../../etc/passwd", lambda t: rag(t, lambda r: r[2]["images"][0].__setitem__(
        0, "../../etc/passwd")), RowFaults({"103": "bad_image_path"}, 3, "outside"), "unclassified"),
    Case("rag-image-nul", "a NUL byte in an image path", lambda t: rag(t, lambda r: r[0]["images"][1].__setitem__(
        0, "img/1b\x00.png")), RowFaults({"101": "bad_image_path"}, 3, "NUL"), "traceback"),
    Case("rag-image-list-string", "a note's image list given as one string",
         lambda t: rag(t, lambda r: r[1]["images"].__setitem__(0, "img/2a.png")),
         RowFaults({"102": "wrong_type"}, 3, "'images[0]' must be a list"), "stop"),
    Case("rag-image-url-number", "an image URL given as a number",
         lambda t: rag(t, lambda r: r[1]["images"][0].__setitem__(0, 12345)),
         RowFaults({"102": "wrong_type"}, 3, "item 0 must be a string"), "silent"),
    Case("rag-row-array", "a row that is a JSON array, not an object", lambda t: rag(t, lambda r: r.__setitem__(
        1, [1, 2, 3])), RowFaults({"line2": "not_an_object"}, 3, "not an object"), "stop"),
    # a reference fault loads (issue 30): the scorer flags and scores it (scoring.reference_faults), see below
    Case("rag-reference-img7-of-2", "the reference answer places IMG#7, the row has 2 images",
         lambda t: rag(t, set_(2, "gt_clean_answer", "看图 ![图](IMG#7)")),
         RowFaults({}, 3, check=lambda samples: _reference_fault_loads(samples)), "silent"),
    Case("rag-no-reference", "neither gt_clean_answer nor gt_answer", lambda t: rag(t, delete(0, "gt_clean_answer")),
         RowFaults({"101": "missing_field"}, 3, "neither 'gt_clean_answer' nor 'gt_answer'"), "stop"),
    Case("rag-reference-number", "gt_clean_answer given as a number", lambda t: rag(t, set_(0, "gt_clean_answer", 5)),
         RowFaults({"101": "wrong_type"}, 3, "'gt_clean_answer' must be a string"), "silent"),
    Case("rag-document-object", "a document given as an object", lambda t: rag(t, lambda r: r[1]["documents"].__setitem__(
        1, {"text": "乙"})), RowFaults({"102": "wrong_type"}, 3, "'documents' item 1 must be a string"), "silent"),
    Case("rag-documents-empty", "documents: [] (and images: [])", lambda t: rag(
        t, lambda r: r[1].update(documents=[], images=[])), RowFaults({"102": "empty_field"}, 3,
                                                                     "'documents' is an empty list"), "silent"),
    Case("rag-missing-image-file", "an image file named by a row is absent", _rag_missing_image_file,
         RowFaults({}, 3, check=lambda samples: None), "unclassified"),
    # --- row faults: OCRBench ----------------------------------------------------------------------
    Case("ocr-missing-question", "a row without 'question'", lambda t: ocr_json(t, delete(1, "question")),
         RowFaults({"1": "missing_field"}, 3, "has no field 'question'"), "stop"),
    Case("ocr-answers-object", "answers given as an object", lambda t: ocr_json(t, set_(0, "answers", {"a": 1})),
         RowFaults({"0": "wrong_type"}, 3, "'answers' must be a string or a list"), "stop"),
    Case("ocr-answers-empty-string", "answers: \"\" (can never match)", lambda t: ocr_json(t, set_(2, "answers", "")),
         RowFaults({"2": "empty_field"}, 3, "'answers' is empty"), "silent"),
    Case("ocr-answers-number-item", "answers [3, \"x\"] (a number among strings)",
         lambda t: ocr_json(t, set_(1, "answers", [3, "x"])),
         RowFaults({"1": "wrong_type"}, 3, "item 0 must be a string"), "silent"),
    Case("ocr-image-path-null", "image_path: null", lambda t: ocr_json(t, set_(0, "image_path", None)),
         RowFaults({"0": "missing_field"}, 3, "'image_path' is null"), "stop"),
    Case("ocr-row-string", "a row that is a string", lambda t: ocr_json(t, lambda r: r.__setitem__(1, "row")),
         RowFaults({"1": "not_an_object"}, 3, "not an object"), "stop"),
    Case("ocr-missing-image-file", "an image file named by a row is absent", _ocr_missing_image_file,
         RowFaults({"1": "image_missing"}, 3, "image file missing"), "unclassified"),
    Case("ocr-tsv-short-row", "a TSV row with two fields missing", lambda t: ocr_tsv(
        t, lambda lines: lines[2].__delitem__(slice(3, 5))), RowFaults({"1": "wrong_column_count"}, 3,
                                                                     "has 3 fields, the header has 5"), "stop"),
    Case("ocr-tsv-long-row", "a TSV row with an extra field (a stray tab)", lambda t: ocr_tsv(
        t, lambda lines: lines[1].insert(2, "stray")), RowFaults({"0": "wrong_column_count"}, 3,
                                                                 "has 6 fields, the header has 5"), "silent"),
    Case("ocr-tsv-bad-literal", "an answer \"['unclosed\"", lambda t: ocr_tsv(
        t, cell(3, "answer", "['unclosed", OCR_TSV_HEADER)), RowFaults({"2": "bad_answer_literal"}, 3,
                                                                     "not a Python literal list"), "stop"),
    Case("ocr-tsv-duplicate-index", "two rows with index 0", lambda t: ocr_tsv(
        t, cell(2, "index", "0", OCR_TSV_HEADER)), RowFaults({"0#1": "duplicate_id"}, 3, "used by an earlier row"),
         "silent"),
    Case("ocr-tsv-bad-base64", "an image cell that is not base64", lambda t: ocr_tsv(
        t, cell(1, "image", "@@not base64@@" * 6, OCR_TSV_HEADER)), RowFaults({"0": "image_undecodable"}, 3,
                                                                            "invalid base64"), "unclassified"),
    # --- row faults: CCBench -----------------------------------------------------------------------
    Case("cc-answer-not-option", "answer letter D, the row has options A-C", lambda t: cc_tsv(
        t, cell(2, "answer", "D", CC_HEADER)), RowFaults({"1": "answer_not_an_option"}, 1 + 3 + 3,
                                                         "not one of the options"), "stop"),
    Case("cc-question-blank", "an empty question", lambda t: cc_tsv(t, cell(1, "question", "", CC_HEADER)),
         RowFaults({"0": "missing_field"}, 1 + 3 + 3, "has no field 'question'"), "stop"),
    Case("cc-option-gap", "options A, B, D (C empty)", lambda t: cc_tsv(
        t, lambda lines: lines[3].__setitem__(slice(4, 6), ["", "长城"])),
         RowFaults({"2": "option_gap"}, 3 + 3 + 1, "skip a letter"), "silent"),
    Case("cc-one-option", "a question with one option", lambda t: cc_tsv(
        t, lambda lines: lines[1].__setitem__(slice(3, 5), ["", ""]) or lines[1].__setitem__(6, "A")),
         RowFaults({"0": "too_few_options"}, 1 + 3 + 3, "1 option(s)"), "stop"),
    Case("cc-index-text", "index 'x1' (not an integer)", lambda t: cc_tsv(t, cell(2, "index", "x1", CC_HEADER)),
         RowFaults({"row2": "bad_index"}, 1 + 3 + 3, "not an integer"), "stop"),
    Case("cc-duplicate-index", "two rows with index 0", lambda t: cc_tsv(t, cell(2, "index", "0", CC_HEADER)),
         RowFaults({"0#bad": "duplicate_id"}, 1 + 3 + 3, "used by an earlier row"), "silent"),
    Case("cc-short-row", "a TSV row cut after the answer", lambda t: cc_tsv(
        t, lambda lines: lines[3].__delitem__(slice(7, 9))), RowFaults({"2": "wrong_column_count"}, 3 + 3 + 1,
                                                                      "has 7 fields, the header has 9"), "stop"),
    Case("cc-image-ref-unresolved", "an image cell naming index 77, absent from the file", lambda t: cc_tsv(
        t, cell(1, "image", "77", CC_HEADER)),
         RowFaults({"0": "image_ref_unresolved", "1000000": "image_ref_unresolved", "2000000": "image_ref_unresolved"},
                   9, "refers to index 77"), "unclassified"),
    # --- row faults through the mix ----------------------------------------------------------------
    Case("mix-cc-row-fault", "a mix whose CCBench source has an answer that is not an option", lambda t: mix(
        t, cell(3, "answer", "Z", CC_HEADER)), RowFaults({"ccbench/2": "answer_not_an_option"}, 6,
                                                         "not one of the options"), "stop"),
]


def _missing_image_check(samples):
    """The RAG-IGBench row whose image file is absent loads (the file is found missing when its images are
    decoded, before generation); decoding marks it as a data error with reason image_missing."""
    from harness.datasets.base import ImageLoadError

    s = {x.uid: x for x in samples}["102"]
    with pytest.raises(ImageLoadError):
        s.load_images()
    assert s.error_reason == "image_missing"


CASES[[c.id for c in CASES].index("rag-missing-image-file")].expect.check = _missing_image_check


def _reference_fault_loads(samples):
    """The row with a reference citing IMG#7 of 2 loads as it is: the scorer judges it, not the loader."""
    s = {x.uid: x for x in samples}["103"]
    assert s.error is None and s.content and s.reference == {"answer": "看图 ![图](IMG#7)", "n_candidates": 2}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_defective_file(case: Case, tmp_path):
    cfg, faulty = case.build(tmp_path)
    if isinstance(case.expect, FileFault):
        with pytest.raises(DatasetError) as err:
            list(load_samples(cfg, tmp_path))
        msg = str(err.value)
        assert "\n" not in msg, msg  # one line
        assert faulty.name.split("\x00")[0] in msg, msg
        assert case.expect.key in msg, msg
        if case.expect.line is not None:
            assert f":{case.expect.line}:" in msg, msg
        assert case.expect.says in msg, msg
        return
    samples = list(load_samples(cfg, tmp_path))
    expect = case.expect
    assert len(samples) == expect.n_samples, [s.uid for s in samples]
    by_uid = {s.uid: s for s in samples}
    assert len(by_uid) == len(samples)  # uids stay unique
    for uid, reason in expect.bad.items():
        s = by_uid[uid]
        assert s.error_reason == reason, (s.error_reason, s.error)
        assert faulty.name in s.error and expect.says in s.error, s.error
        if not reason.startswith("image"):
            assert re.search(rf"{re.escape(faulty.name)}:\d+", s.error), s.error  # file:line
        assert s.content == [] or reason.startswith("image"), "a defective row sends no prompt"
    good = [s for s in samples if s.uid not in expect.bad]
    assert all(s.error is None and s.error_reason is None for s in good), [(s.uid, s.error) for s in good]
    assert all(s.content for s in good)
    if expect.check:
        expect.check(samples)


def test_corpus_is_large_and_covers_every_loader():
    files = [c for c in CASES if isinstance(c.expect, FileFault)]
    rows = [c for c in CASES if isinstance(c.expect, RowFaults)]
    assert len(CASES) >= 30 and len(files) >= 10 and len(rows) >= 20
    assert {c.id.split("-")[0] for c in files} == {c.id.split("-")[0] for c in rows} == {"rag", "ocr", "cc", "mix"}
    from harness.datasets.faults import REASONS

    used = {r for c in rows for r in c.expect.bad.values()} | {"image_missing", "reference_image_out_of_range"}
    assert used <= set(REASONS) and len(used) >= 15


# ------------------------------------------------------------------------------- reference vs model


def test_a_reference_citing_img7_of_2_is_the_datas_fault_not_the_models():
    """Strict (``reference_faults="error"``): a model that copies a defective reference is never charged with
    ``hallucinated_image``. Default (``score``, the public scorer's treatment): the sample is flagged and
    judged as the public scorer judges it — the copy places IMG#7 of 2, a hallucination there."""
    from harness.metrics import rag_igbench as rb

    ref = "看图 ![图](IMG#7)"
    copy = json.dumps({"answer": ref}, ensure_ascii=False)
    s = rb.score_sample(copy, ref, n_candidates=2, reference_faults="error")
    assert s["reference_fault"] is True and s["hallucinated_image"] is False
    assert "reference" in s["reason"] and s["rouge1"] == 0.0
    m = rb.aggregate([s, rb.score_sample(json.dumps({"answer": "![x](IMG#3)"}), "![y](IMG#1)", n_candidates=2)])
    assert m["hallucinated_image"] == 1 and m["reference_faults"] == 1 and m["errors"] == 1
    d = rb.score_sample(copy, ref, n_candidates=2)
    assert d["reference_fault"] is True and d["error"] is None and "IMG#7" in d["reference_fault_reason"]
    assert d["hallucinated_image"] is True and rb.aggregate([d])["reference_faults"] == 1


# ------------------------------------------------------------------------------------ end to end


class ScriptedEngine:
    """Answers each request from ``script`` (uid → text); a uid in ``fail`` gets an engine error."""

    name = "scripted"
    script: dict[str, str] = {}
    fail: set[str] = set()

    def __init__(self, *args, **kwargs):
        pass

    def generate_batch(self, requests):
        from harness.engines.base import Generation

        return [Generation(uid=r.uid, text="" if r.uid in self.fail else self.script.get(r.uid, "no json"),
                           error="engine exploded" if r.uid in self.fail else None, prompt_tokens=10,
                           output_tokens=5, ttft_ms=1.0, tpot_ms=0.5, e2e_ms=3.0) for r in requests]

    def describe(self):
        return {"engine": "scripted", "engine_version": "0", "device": "cpu", "dtype": "float32"}

    def close(self):
        pass


def run_scripted(tmp_path, monkeypatch, overrides: list[str], script: dict[str, str], fail=()) -> dict:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from harness.config.schema import register_configs
    from harness.engines import ENGINES
    from harness.run.experiment import run_experiment

    monkeypatch.setitem(ENGINES, "scripted", f"{__name__}:ScriptedEngine")
    monkeypatch.setattr(ScriptedEngine, "script", script)
    monkeypatch.setattr(ScriptedEngine, "fail", set(fail))
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "engine.name=scripted", "wandb.mode=disabled", "model.embedded=false", "model.path=unused",
                "cache.enabled=false", "scoring.clip_model=null", "scoring.embed_model=null", *overrides])
    finally:
        GlobalHydra.instance().clear()
    return run_experiment(cfg, tmp_path / "run")


def read_samples(tmp_path) -> dict[str, dict]:
    lines = (tmp_path / "run/samples.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["uid"]: r for r in map(json.loads, lines)}


def test_rag_run_scores_good_rows_and_counts_data_errors_by_reason(tmp_path, monkeypatch):
    def mutate(rows):
        extra = [dict(rows[0], id=200 + i) for i in range(5)]
        extra[0]["documents"] = None  # crashed the run before
        extra[1]["documents"] = "一段笔记"  # was split into characters
        extra[2]["documents"] = ["甲", "乙", "丙"]  # 3 documents, 2 image lists: dropped the third
        extra[3]["query"] = None  # "None" in the prompt
        extra[4]["gt_clean_answer"] = "看图 ![图](IMG#7)"  # was the model's hallucination
        rows.extend(extra)

    cfg, path = rag(tmp_path / "data", mutate)
    (tmp_path / "data/img/3a.png").unlink()  # row 103: an image missing on disk
    answers = {str(r["id"]): json.dumps({"answer": r["gt_clean_answer"]}, ensure_ascii=False) for r in rag_rows()}
    answers["200"] = answers["204"] = json.dumps({"answer": "看图 ![图](IMG#7)"}, ensure_ascii=False)
    summary = run_scripted(tmp_path, monkeypatch, [f"dataset.path={path}", "dataset.image_root=null"], answers,
                           fail={"102"})
    m = summary["metrics"]
    assert m["n_samples"] == 8 and m["n_scored"] == 1  # 101 only: 102 engine error, 103 image, 5 defective rows
    assert m["data_errors"] == {"total": 6, "by_reason": {
        "documents_images_mismatch": 1, "image_missing": 1, "missing_field": 2, "reference_image_out_of_range": 1,
        "wrong_type": 1}}
    # 204 (reference IMG#7 of 2) is generated and scored as the public scorer does (scoring.reference_faults=score,
    # the default): the scripted copy places IMG#7 of 2, a hallucination there; counted in data_errors by its
    # reference fault all the same
    assert m["hallucinated_image"] == 1 and m["errors"] == 6 and m["reference_faults"] == 1
    assert m["rouge1"] == pytest.approx(1 / 8) and m["rouge1_valid_only"] == pytest.approx(1.0)
    recs = read_samples(tmp_path)
    assert recs["101"]["error"] is None and recs["101"]["error_kind"] is None
    assert recs["102"]["error_kind"] == "engine" and recs["102"]["error_reason"] is None
    assert recs["103"]["error_kind"] == "data" and recs["103"]["error_reason"] == "image_missing"
    for uid, reason in (("200", "missing_field"), ("201", "wrong_type"), ("202", "documents_images_mismatch"),
                        ("203", "missing_field")):
        rec = recs[uid]
        assert rec["error_kind"] == "data" and rec["error_reason"] == reason, rec
        assert "data.jsonl:" in rec["error"] and rec["scores"]["rouge1"] == 0.0 and rec["prompt_tokens"] is None
        assert rec["scores"]["hallucinated_image"] is False
    rec = recs["204"]
    assert rec["error"] is None and rec["prompt_tokens"] is not None and rec["scores"]["reference_fault"] is True
    assert "IMG#7" in rec["scores"]["reference_fault_reason"] and rec["scores"]["hallucinated_image"] is True
    assert summary["run"]["scoring"]["reference_faults"] == "score"

    # the strict treatment: the same sample is an error, never the model's hallucination
    shutil.rmtree(tmp_path / "run")
    summary = run_scripted(tmp_path, monkeypatch, [f"dataset.path={path}", "dataset.image_root=null",
                                                   "scoring.reference_faults=error"], answers, fail={"102"})
    m = summary["metrics"]
    assert m["n_scored"] == 1 and m["hallucinated_image"] == 0 and m["errors"] == 7 and m["reference_faults"] == 1
    assert m["data_errors"]["by_reason"]["reference_image_out_of_range"] == 1 and m["data_errors"]["total"] == 6
    rec = read_samples(tmp_path)["204"]
    assert rec["scores"]["reference_fault"] is True and rec["scores"]["hallucinated_image"] is False
    assert rec["scores"]["error"].startswith("reference_fault") and rec["scores"]["rouge1"] == 0.0
    assert summary["run"]["scoring"]["departures"] == ["scoring.reference_faults=error"]


def test_ocrbench_and_ccbench_runs_score_good_rows_and_count_data_errors(tmp_path, monkeypatch):
    (tmp_path / "o").mkdir()
    cfg, path = ocr_tsv(tmp_path / "o", lambda lines: (lines[2].__delitem__(slice(3, 5)),
                                                      lines[3].__setitem__(3, "['unclosed")))
    summary = run_scripted(tmp_path, monkeypatch, ["dataset=ocrbench", f"dataset.path={path}"],
                           {"0": "It says WORD."})
    m = summary["metrics"]
    assert m["n"] == 3 and m["correct"] == 1 and m["errors"] == 2 and m["ocrbench_score"] == pytest.approx(1000 / 3)
    assert m["data_errors"] == {"total": 2, "by_reason": {"bad_answer_literal": 1, "wrong_column_count": 1}}

    shutil.rmtree(tmp_path / "run")
    cfg, path = cc_tsv(tmp_path, cell(2, "answer", "D", CC_HEADER))  # question 1: answer not an option
    script = {uid: "B" for uid in ("0", "2")} | {"1000000": "A", "2000000": "C", "1000002": "A", "2000002": "C"}
    summary = run_scripted(tmp_path, monkeypatch, ["dataset=ccbench", f"dataset.path={path}"], script)
    m = summary["metrics"]
    assert m["n_questions"] == 3 and m["mcq_accuracy"] == pytest.approx(2 / 3) and m["errors"] == 1
    assert m["data_errors"] == {"total": 1, "by_reason": {"answer_not_an_option": 1}}
    assert read_samples(tmp_path)["1"]["error_reason"] == "answer_not_an_option"


def test_cli_refuses_a_non_utf8_file_with_one_line_and_exit_2(tmp_path):
    cfg, path = rag(tmp_path, raw=json.dumps(rag_rows()[0]).encode() + b"\n" + b'{"id": 2, "query": "caf\xe9"}\n')
    env = {**os.environ, "WANDB_SILENT": "true"}
    proc = subprocess.run([sys.executable, "-m", "harness", f"dataset.path={path}", f"hydra.run.dir={tmp_path / 'r'}",
                           "wandb.mode=disabled"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"{path}:2: not UTF-8" in errors[0] and "dataset.path" in errors[0]
