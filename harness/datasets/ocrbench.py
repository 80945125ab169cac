"""OCRBench v1 (Liu et al., 2023; Yuliang-Liu/MultimodalOCR): 1,000 OCR questions, one image each.

Three layouts are read, chosen by the file extension, by what a folder holds, or by a ``format`` hint
(``json`` | ``tsv`` | ``hf``; read from ``cfg.format`` when the config has such a key, e.g. a mix source):

* ``json`` — the original release: ``OCRBench.json`` (a JSON array of ``dataset_name, id, image_path,
  question, answers, type``) and the image folder; ``image_path`` is resolved under ``dataset.image_root``
  (default: an ``OCRBench_Images`` folder beside the JSON file if there is one, else the JSON file's folder)
  and can never leave it. ``answers`` is a string in 851 rows and a list in 149: always a list here.
* ``tsv`` — VLMEvalKit's ``OCRBench.tsv``: ``index, image`` (base64), ``question, answer`` (a Python-literal
  list, read with ``ast.literal_eval``), ``category`` (the type). The TSV has no ``dataset_name``: it is
  set to ``HME100k`` for the handwritten-formula type (the one rule that needs it) and ``unknown`` otherwise.
* ``hf`` — the Hugging Face layout (``echo840/OCRBench``): ``question, question_type, answer, image,
  dataset``, from a ``save_to_disk`` folder, a folder of parquet/arrow files or one such file. Needs the
  optional ``datasets`` library. An image cell without bytes (``{bytes: null, path}``) names a file, which is
  resolved like ``image_path`` above, under the data root (``dataset.image_root``, default: the dataset's
  folder) and can never leave it: an absolute path or a ``..`` escape is the row's ``bad_image_path`` fault
  (a data file must not make the harness read arbitrary files of the machine, issue 26).

Upstream ``id`` is not unique (857 distinct values in 1,000 rows), so a sample's ``uid`` is its 0-based row
position (``json``, ``hf``) or the TSV ``index`` (VLMEvalKit's own key, which equals the position there).

Prompt: the image, then the question verbatim — what the official OCRBench scripts send
(``MultimodalOCR/OCRBench/scripts/*.py``), image first as in VLMEvalKit's ``build_prompt``.
"""

from __future__ import annotations

import ast
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.datasets._io import (
    cfg_get,
    config_key,
    data_path,
    decode_b64,
    image_root_of,
    is_image_ref,
    iter_json_rows,
    iter_tsv,
)
from harness.datasets.base import DatasetError, ImageInput, PathEscapeError, Sample, resolve_under
from harness.datasets.faults import RowFault, UniqueIds, cell, data_error_sample, id_field, require, text_field

SOURCE = "ocrbench"
HME_TYPE = "Handwritten Mathematical Expression Recognition"
JSON_FIELDS = ("dataset_name", "id", "image_path", "question", "answers", "type")
TSV_FIELDS = ("index", "image", "question", "answer", "category")
HF_FIELDS = ("question", "question_type", "answer", "image", "dataset")
FORMATS = ("json", "tsv", "hf")


def normalise_answers(value: Any, field: str = "answers") -> list[str]:
    """A string or a list of strings → a list of strings with at least one non-blank answer.

    Never coerced: a number, an object or a list holding a non-string is ``wrong_type`` (all 1,000 upstream
    answers are strings); no usable answer is ``empty_field`` (an empty answer can never be matched, so the
    row would silently score 0 whatever the model says)."""
    if value is None:
        raise RowFault("missing_field", f"field {field!r} is null")
    if isinstance(value, str):
        answers = [value]
    elif isinstance(value, (list, tuple)):
        answers = list(value)
        for i, a in enumerate(answers):
            if not isinstance(a, str):
                raise RowFault("wrong_type", f"field {field!r} item {i} must be a string, got {type(a).__name__}")
    else:
        raise RowFault("wrong_type", f"field {field!r} must be a string or a list of strings, "
                                     f"got {type(value).__name__}")
    if not any(a.strip() for a in answers):
        raise RowFault("empty_field", f"field {field!r} is empty")
    return answers


def make_sample(uid: str, dataset: str, question: str, answers: list[str], dataset_name: str, qtype: str,
                image: ImageInput, error: str | None = None, error_reason: str | None = None, **meta: Any) -> Sample:
    """One OCRBench sample in the project's convention (image first, then the question)."""
    return Sample(
        uid=uid,
        dataset=dataset,
        task="ocrbench",
        content=[{"type": "image", "index": 0}, {"type": "text", "text": question}],
        images=[image],
        reference={"answers": answers, "dataset_name": dataset_name, "type": qtype},
        meta={"source": SOURCE, "category": qtype, "type": qtype, "dataset_name": dataset_name, **meta},
        error=error,
        error_reason=error_reason if error else None,
    )


def error_sample(uid: str, dataset: str, where: str, fault: RowFault, row: Any, type_key: str, **meta: Any
                 ) -> Sample:
    """The data-error sample of a defective row; it keeps the row's type where that is readable, so the
    per-type accuracy counts it."""
    qtype = row.get(type_key) if isinstance(row, dict) else None
    qtype = qtype.strip() if isinstance(qtype, str) and qtype.strip() else "unknown"
    return data_error_sample(uid, dataset, "ocrbench", where, fault,
                             reference={"answers": [], "dataset_name": None, "type": qtype},
                             meta={"source": SOURCE, "category": qtype, "type": qtype, **meta})


def detect_format(path: Path, hint: str | None, prefix: str = "dataset") -> tuple[str, Path]:
    """``(format, file or folder to read)`` from the hint, the extension or the folder's content."""
    if hint:
        if hint not in FORMATS:
            raise DatasetError(f"unknown OCRBench format {hint!r} ({prefix}.format); known: {FORMATS}")
        if path.is_dir() and hint == "json":
            return hint, _find_one(path, ("OCRBench.json",), "*.json", prefix)
        if path.is_dir() and hint == "tsv":
            return hint, _find_one(path, ("OCRBench.tsv",), "*.tsv", prefix)
        return hint, path
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in {".json", ".jsonl"}:
            return "json", path
        if suffix == ".tsv":
            return "tsv", path
        if suffix in {".parquet", ".arrow"}:
            return "hf", path
        raise DatasetError(f"cannot tell the OCRBench layout of {path} from its extension ({prefix}.path); "
                           f"set {prefix}.format to one of {FORMATS}")
    if (path / "OCRBench.json").is_file():
        return "json", path / "OCRBench.json"
    if (path / "OCRBench.tsv").is_file():
        return "tsv", path / "OCRBench.tsv"
    if any((path / m).exists() for m in ("dataset_info.json", "dataset_dict.json", "state.json")) or \
            any(path.rglob("*.parquet")) or any(path.rglob("*.arrow")):
        return "hf", path
    raise DatasetError(f"{path}: no OCRBench.json, OCRBench.tsv or Hugging Face files found ({prefix}.path)")


def _find_one(folder: Path, names: tuple[str, ...], pattern: str, prefix: str = "dataset") -> Path:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    found = sorted(folder.glob(pattern))
    if len(found) != 1:
        raise DatasetError(f"{folder}: expected one {pattern} file, found {len(found)} ({prefix}.path)")
    return found[0]


# --- original JSON + image folder -----------------------------------------------------------------

def json_row_to_sample(pos: int, row: Any, image_root: Path, dataset: str, where: str = "") -> Sample:
    """One row of ``OCRBench.json`` → one sample; a defect is a :class:`RowFault`. A missing image file is
    an error of the sample (``image_missing``), found here so the run never sends it to the engine."""
    if not isinstance(row, dict):
        raise RowFault("not_an_object", f"row is a JSON {type(row).__name__}, not an object")
    id_field(row, "id")  # upstream ids repeat (857 distinct in 1,000 rows): checked, never a key
    question = text_field(row, "question")
    answers = normalise_answers(require(row, "answers"))
    dataset_name, qtype = text_field(row, "dataset_name"), text_field(row, "type")
    rel = text_field(row, "image_path")
    try:
        file = resolve_under(image_root, rel)
    except PathEscapeError as e:
        raise RowFault("bad_image_path", f"rejected image path: {e}") from e
    error = None if file.is_file() else (f"{where + ': ' if where else ''}image file missing: {file} "
                                         f"(image_path {rel!r} under {image_root})")
    return make_sample(
        uid=str(pos), dataset=dataset, question=question, answers=answers, dataset_name=dataset_name, qtype=qtype,
        image=ImageInput(source=SOURCE, path=file, key=rel), error=error, error_reason="image_missing",
        id=row["id"], position=pos,
    )


def iter_json(path: Path, image_root: Path, dataset: str, key: str = "dataset.path") -> Iterator[Sample]:
    for pos, lineno, row in iter_json_rows(path, key):
        where = f"{path}:{lineno}: row {pos}" + (f" (id={row.get('id')!r})" if isinstance(row, dict) else "")
        try:
            yield json_row_to_sample(pos, row, image_root, dataset, where)
        except RowFault as fault:
            yield error_sample(str(pos), dataset, where, fault, row, "type", position=pos)


# --- VLMEvalKit TSV -------------------------------------------------------------------------------

def parse_literal_answers(value: str) -> list[str]:
    """VLMEvalKit stores ``answer`` as a Python literal list (``"['CENTRE']"``); a bare string is accepted."""
    text = value.strip()
    if text.startswith(("[", "(")):
        try:
            parsed = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
            raise RowFault("bad_answer_literal", f"field 'answer' is not a Python literal list: {e}") from e
        return normalise_answers(parsed, "answer")
    return normalise_answers(value, "answer")


def iter_tsv_samples(path: Path, dataset: str, key: str = "dataset.path") -> Iterator[Sample]:
    """Samples of VLMEvalKit's ``OCRBench.tsv``; a defective row is a data-error sample (file order kept,
    except rows whose image cell names a row further down, which follow at the end)."""
    images: dict[str, bytes | None] = {}  # index → decoded image (None: bad), for rows that refer to it
    deferred: list[tuple[str, dict, int, int]] = []
    ids = UniqueIds()

    def build(row: dict, n: int, line: int, image: ImageInput, error: str | None, reason: str | None) -> Sample:
        idx = row["index"].strip()
        uid, taken = ids.claim(idx)
        where = f"{path}:{line}: row {n} (index={idx})"
        try:
            if taken:
                raise RowFault("duplicate_id", f"index {idx} is used by an earlier row (indices key results)")
            question, qtype = cell(row, "question"), cell(row, "category").strip()
            answers = parse_literal_answers(cell(row, "answer"))
        except RowFault as fault:
            return error_sample(uid, dataset, where, fault, row, "category", index=idx)
        dataset_name = (row.get("dataset_name") or "").strip() or ("HME100k" if qtype == HME_TYPE else "unknown")
        return make_sample(
            uid=uid, dataset=dataset, question=question, answers=answers, dataset_name=dataset_name, qtype=qtype,
            image=image, error=error, error_reason=reason, index=idx,
        )

    for n, line, row, column_fault in iter_tsv(path, TSV_FIELDS, key):
        idx = (row.get("index") or "").strip()
        if column_fault or not idx:
            fault = RowFault("wrong_column_count", column_fault) if column_fault else \
                RowFault("missing_field", "has no field 'index'")
            uid, _ = ids.claim(idx or f"row{n}")
            yield error_sample(uid, dataset, f"{path}:{line}: row {n} (index={idx or '?'})", fault, row, "category",
                               index=idx or None)
            continue
        raw = row.get("image") or ""
        img_key = f"{path.name}:index={idx}"
        if is_image_ref(raw):
            ref = raw.strip()
            if ref in images:
                data = images[ref]
                error = None if data is not None else f"image of row {img_key} refers to index {ref}, whose image is bad"
                yield build(row, n, line, ImageInput(source=SOURCE, data=data, key=img_key), error,
                            "image_ref_unresolved")
            else:
                deferred.append((ref, row, n, line))
            continue
        try:
            data, error = decode_b64(raw), None
        except ValueError as e:
            data, error = None, f"image of row {img_key} cannot be decoded: {e}"
        images.setdefault(idx, data)  # a repeated index never replaces the image rows refer to
        yield build(row, n, line, ImageInput(source=SOURCE, data=data, key=img_key), error, "image_undecodable")
    for ref, row, n, line in deferred:  # references to rows further down the file
        img_key = f"{path.name}:index={row['index'].strip()}"
        data = images.get(ref)
        error = None if data is not None else (
            f"image of row {img_key} refers to index {ref}, which has no image in the file")
        yield build(row, n, line, ImageInput(source=SOURCE, data=data, key=img_key), error, "image_ref_unresolved")


# --- Hugging Face layout --------------------------------------------------------------------------

def _hf_dataset(path: Path, split: str | None):
    try:
        import datasets

        if not hasattr(datasets, "load_dataset"):  # a bare ``datasets/`` folder on sys.path (this repo has one)
            raise ImportError("only a namespace package named 'datasets' was found")
    except ImportError as e:
        raise DatasetError(
            f"{path}: reading the Hugging Face layout of OCRBench needs the `datasets` library: "
            "pip install datasets (or convert the data to OCRBench.json + images, or use VLMEvalKit's "
            "OCRBench.tsv, which need nothing extra)"
        ) from e
    markers = ("dataset_info.json", "dataset_dict.json", "state.json")
    if path.is_dir() and any((path / m).exists() for m in markers):
        ds = datasets.load_from_disk(str(path))
    else:
        files = [path] if path.is_file() else (sorted(path.rglob("*.parquet")) or sorted(path.rglob("*.arrow")))
        if not files:
            raise DatasetError(f"{path}: no parquet or arrow files (dataset.path)")
        builder = "parquet" if files[0].suffix == ".parquet" else "arrow"
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train")
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        name = split if split in ds else ("test" if "test" in ds else names[0])
        if split and split not in ds:
            raise DatasetError(f"{path}: no split {split!r} (dataset.split); splits: {names}")
        ds = ds[name]
    if "image" in ds.column_names:
        ds = ds.cast_column("image", datasets.Image(decode=False))
    return ds


def hf_image_bytes(value: Any) -> bytes | None:
    """The encoded bytes a Hugging Face image cell carries ({bytes, path} dict, raw bytes or a PIL image); a
    cell that only names a file is :func:`hf_image_input`'s business (its path must stay under the data root)."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, dict):
        return bytes(value["bytes"]) if value.get("bytes") else None
    if hasattr(value, "save"):  # a decoded PIL image
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    return None


def hf_image_input(value: Any, key: str, data_root: Path | None) -> tuple[ImageInput, str | None]:
    """The image of a Hugging Face cell and its error (None: usable). A cell that names a file instead of
    carrying bytes is resolved under ``data_root`` with :func:`~harness.datasets.base.resolve_under`, the check
    every other layout's image paths pass: absolute, ``..``-escaping, NUL-holding or non-string paths — and any
    path when no data root is known — are the row's ``bad_image_path`` :class:`RowFault`."""
    if isinstance(value, dict) and not value.get("bytes") and value.get("path") is not None:
        rel = value["path"]
        if data_root is None:
            raise RowFault("bad_image_path", f"rejected image path {rel!r}: no data root to resolve it under")
        try:
            file = resolve_under(data_root, rel)
        except PathEscapeError as e:
            raise RowFault("bad_image_path", f"rejected image path: {e}") from e
        error = None if file.is_file() else f"image file missing: {file} (image cell path {rel!r} under {data_root})"
        return ImageInput(source=SOURCE, path=file, key=key), error
    data = hf_image_bytes(value)
    return ImageInput(source=SOURCE, data=data, key=key), None if data else f"image of row {key} is missing"


def hf_row_to_sample(pos: int, row: dict, where: str, dataset: str, data_root: Path | None = None) -> Sample:
    """One Hugging Face row → one sample (pure: testable without the ``datasets`` library); a defective row
    is a data-error sample. ``data_root`` is where image cells that name a file may point (None: nowhere)."""
    key = f"{Path(where).name}:row={pos}"
    try:
        question, qtype = text_field(row, "question"), text_field(row, "question_type")
        dataset_name = text_field(row, "dataset")
        answers = normalise_answers(require(row, "answer"), "answer")
        image, error = hf_image_input(row.get("image"), key, data_root)
    except RowFault as fault:
        return error_sample(str(pos), dataset, f"{where}: row {pos}", fault, row, "question_type", position=pos)
    return make_sample(
        uid=str(pos), dataset=dataset, question=question, answers=answers, dataset_name=dataset_name, qtype=qtype,
        image=image, error=error, error_reason="image_missing", position=pos,
    )


def iter_hf(path: Path, split: str | None, dataset: str, data_root: Path | None = None) -> Iterator[Sample]:
    for pos, row in enumerate(_hf_dataset(path, split)):
        yield hf_row_to_sample(pos, row, str(path), dataset, data_root)


# --- entry point ----------------------------------------------------------------------------------

def load(cfg, root: Path) -> Iterator[Sample]:
    """OCRBench samples in file order, cut at ``limit`` (streamed)."""
    path = data_path(cfg, root)
    fmt, file = detect_format(path, cfg_get(cfg, "format"), cfg_get(cfg, "config_key", "dataset"))
    name = cfg_get(cfg, "name", "ocrbench")
    key = config_key(cfg, "path")
    if fmt == "json":
        beside = file.parent / "OCRBench_Images"
        samples = iter_json(file, image_root_of(cfg, root, beside if beside.is_dir() else file.parent), name, key)
    elif fmt == "tsv":
        samples = iter_tsv_samples(file, name, key)
    else:
        data_root = image_root_of(cfg, root, file if file.is_dir() else file.parent)  # where path cells may point
        samples = iter_hf(file, cfg_get(cfg, "split"), name, data_root)
    limit = cfg_get(cfg, "limit")
    for n, sample in enumerate(samples):
        if limit is not None and n >= limit:
            return
        yield sample
