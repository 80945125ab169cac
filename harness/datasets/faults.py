"""Row-level data faults: one bad row becomes one data-error sample, never a stopped run.

Why: a benchmark file of thousands of rows with one defective row (``documents: null``, an answer letter that
is not an option, three notes with two image lists) must still be evaluated, and the defect must be visible.
So every loader checks each row against its benchmark's schema with the helpers below; a defect raises
:class:`RowFault` with a stable ``reason`` code, and the loader turns it into a :class:`~.base.Sample` that
carries the message (file, line, field) and the code. The run records it with ``error_kind: "data"``, scores
it 0, and counts it in ``summary.json`` ``metrics.data_errors`` (``total``, ``by_reason``).

Nothing is coerced: a string where a list belongs, a number where a string belongs, ``null`` where a value is
required is a fault of its row (a string would otherwise be split into characters, ``None`` would be printed
into the prompt). Faults of the *file* (missing, unreadable, not JSON/TSV, not UTF-8, empty) are
:class:`~.base.DatasetError`\\ s instead: they stop the run before the model loads (exit 2).
"""

from __future__ import annotations

from typing import Any

from harness.datasets.base import Sample

#: Every reason code a row fault can carry, with what it means (the keys of ``metrics.data_errors.by_reason``).
REASONS: dict[str, str] = {
    "not_an_object": "a JSON row that is not an object (a list, a string, null)",
    "missing_field": "a required field is absent, null, or a blank TSV cell",
    "wrong_type": "a field of the wrong type, e.g. a string where a list belongs (never coerced)",
    "empty_field": "a required field that is empty (empty string or list)",
    "wrong_column_count": "a TSV row with fewer or more fields than its header",
    "duplicate_id": "an id (index) an earlier row of the file already has",
    "documents_images_mismatch": "RAG-IGBench: the number of image lists differs from the number of documents",
    "reference_image_out_of_range": "the reference answer places an image IMG#k outside 1..candidates",
    "bad_image_path": "an image path that is absolute, leaves the image root, or holds a NUL byte",
    "image_missing": "an image file that does not exist (or a missing image cell)",
    "image_undecodable": "an image that cannot be decoded (truncated file, invalid base64)",
    "image_ref_unresolved": "a TSV image cell naming another row's index that has no usable image",
    "bad_answer_literal": "an OCRBench TSV answer that is not a Python-literal list of strings",
    "too_few_options": "a multiple-choice row with fewer than two options",
    "option_gap": "a multiple-choice row whose options skip a letter (A, B, D)",
    "answer_not_an_option": "a multiple-choice answer letter that is not one of the row's options",
    "bad_index": "a TSV index that is not an integer",
}


class RowFault(ValueError):
    """A defect of one row (``reason`` is a key of :data:`REASONS`); the message names the field."""

    def __init__(self, reason: str, message: str):
        if reason not in REASONS:
            raise ValueError(f"unknown data-fault reason {reason!r}")
        super().__init__(message)
        self.reason = reason


def _type_name(value: Any) -> str:
    return "null" if value is None else {"str": "string", "dict": "object", "list": "list", "bool": "boolean",
                                         "int": "number", "float": "number"}.get(type(value).__name__,
                                                                                 type(value).__name__)


def require(row: dict, key: str) -> Any:
    """``row[key]``; absent or null → ``missing_field``."""
    if key not in row:
        raise RowFault("missing_field", f"has no field {key!r}")
    if row[key] is None:
        raise RowFault("missing_field", f"field {key!r} is null")
    return row[key]


def text_field(row: dict, key: str, *, allow_empty: bool = False) -> str:
    """A required string field, never coerced (a number or a list is ``wrong_type``)."""
    value = require(row, key)
    if not isinstance(value, str):
        raise RowFault("wrong_type", f"field {key!r} must be a string, got {_type_name(value)} {_short(value)}")
    if not allow_empty and not value.strip():
        raise RowFault("empty_field", f"field {key!r} is empty")
    return value


def list_field(row: dict, key: str, *, allow_empty: bool = False) -> list:
    """A required list field (a string here would be split into characters: ``wrong_type``)."""
    value = require(row, key)
    if not isinstance(value, list):
        raise RowFault("wrong_type", f"field {key!r} must be a list, got {_type_name(value)} {_short(value)}")
    if not allow_empty and not value:
        raise RowFault("empty_field", f"field {key!r} is an empty list")
    return value


def string_items(values: list, key: str) -> list[str]:
    """The items of a list field, each of which must be a string."""
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise RowFault("wrong_type", f"field {key!r} item {i} must be a string, got {_type_name(v)} {_short(v)}")
    return values


def id_field(row: dict, key: str = "id") -> str:
    """An id: an integer (not a boolean, not ``5.0``) or a non-empty string, as text."""
    value = require(row, key)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise RowFault("wrong_type", f"field {key!r} must be an integer or a string, got {_type_name(value)} "
                                     f"{_short(value)}")
    text = str(value)
    if not text.strip():
        raise RowFault("empty_field", f"field {key!r} is empty")
    return text


def cell(row: dict, key: str) -> str:
    """A required TSV cell: absent, empty, or pandas' ``nan`` → ``missing_field``."""
    value = row.get(key)
    if value is None or not value.strip() or value.strip() in {"nan", "NaN"}:
        raise RowFault("missing_field", f"has no field {key!r}")
    return value


def _short(value: Any, n: int = 40) -> str:
    text = repr(value)
    return f"({text[:n]}…)" if len(text) > n else f"({text})"


class UniqueIds:
    """Uids unique within a file: a repeated id is a ``duplicate_id`` fault of the later row, whose uid gets
    ``#k`` so results and cache keys never collide."""

    def __init__(self) -> None:
        self.seen: dict[str, int] = {}

    def claim(self, uid: str) -> tuple[str, bool]:
        """``(unique uid, whether uid was taken before)``."""
        count = self.seen.get(uid, 0)
        self.seen[uid] = count + 1
        if not count:
            return uid, False
        unique = f"{uid}#{count}"
        while unique in self.seen:
            count += 1
            unique = f"{uid}#{count}"
        self.seen[unique] = 1
        return unique, True


def data_error_sample(uid: str, dataset: str, task: str, where: str, fault: RowFault,
                      reference: dict[str, Any] | None = None, meta: dict[str, Any] | None = None) -> Sample:
    """The sample of a defective row: no prompt, no images, the fault's message (with ``where``) and reason."""
    return Sample(uid=uid, dataset=dataset, task=task, content=[], images=[], reference=dict(reference or {}),
                  meta={**(meta or {}), "data_error": fault.reason}, error=f"{where}: {fault}",
                  error_reason=fault.reason)
