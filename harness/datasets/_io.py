"""Reading helpers shared by the OCRBench, CCBench and mix loaders.

* :func:`data_path` / :func:`image_root_of`: config paths resolved from the project root, with errors
  that name the config key.
* :func:`iter_tsv`: VLMEvalKit TSVs read row by row with the ``csv`` module (tab-separated, fields with
  newlines quoted, ``utf-8-sig``), the field size limit raised for base64 images.
* :func:`decode_b64`: base64 image fields, strict (a corrupt field fails its sample, not the file).
* :func:`is_image_ref`: VLMEvalKit's rule for an ``image`` field that holds another row's index instead of
  base64 (``len <= 64``, ``ImageBaseDataset.__init__``).
"""

from __future__ import annotations

import base64
import binascii
import csv
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.datasets.base import DatasetError

IMAGE_REF_MAX_LEN = 64  # VLMEvalKit: an image field this short is the index of the row holding the image


def cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` for a dataclass, a DictConfig (struct or not) or a plain dict; ``default`` if absent."""
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    try:
        value = getattr(cfg, key)
    except (AttributeError, KeyError):
        return default
    return default if value is None else value


def data_path(cfg: Any, root: Path, key: str = "dataset.path") -> Path:
    """The configured data file or folder, relative paths from ``root``; missing → :class:`DatasetError`."""
    raw = cfg_get(cfg, "path")
    if not raw:
        raise DatasetError(f"{key} is not set for dataset {cfg_get(cfg, 'name', '?')!r}")
    path = Path(raw).expanduser()
    path = path if path.is_absolute() else root / path
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path} (set by {key})")
    return path


def image_root_of(cfg: Any, root: Path, default: Path, key: str = "dataset.image_root") -> Path:
    """The configured image root (default ``default``), which must be a folder."""
    raw = cfg_get(cfg, "image_root")
    image_root = Path(raw).expanduser() if raw else default
    image_root = image_root if image_root.is_absolute() else root / image_root
    if not image_root.is_dir():
        raise DatasetError(f"image root not found: {image_root} (set by {key})")
    return image_root


def _raise_csv_field_limit() -> None:
    limit = sys.maxsize
    while True:
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:  # C long is 32-bit on some platforms
            limit //= 10


def iter_tsv(path: Path, required_columns: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    """Stream ``(row number, row)`` from a VLMEvalKit TSV; a missing column is a :class:`DatasetError`.

    Row numbers count data rows from 1 (the header is row 0). Short rows get ``None`` for the missing
    trailing fields (the ``csv`` module's behaviour), which the loaders treat as a missing field.
    """
    _raise_csv_field_limit()
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f, delimiter="\t")
        header = reader.fieldnames or []
        missing = [c for c in required_columns if c not in header]
        if missing:
            raise DatasetError(f"{path}: header has no column {missing[0]!r} (columns: {header})")
        try:
            for n, row in enumerate(reader, start=1):
                yield n, row
        except csv.Error as e:
            raise DatasetError(f"{path}: malformed TSV near line {reader.line_num}: {e}") from e


def iter_json_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """``(position, row)`` from a JSON array file or a JSON Lines file; positions count from 0."""
    with open(path, encoding="utf-8-sig") as f:
        head = f.read(1)
        while head and head.isspace():
            head = f.read(1)
        f.seek(0)
        if head == "[":
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}: not valid JSON: {e}") from e
            yield from enumerate(rows)
            return
        pos = 0
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                try:
                    yield pos, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}: line {lineno} is not valid JSON: {e}") from e
                pos += 1


def is_image_ref(value: str) -> bool:
    """VLMEvalKit's rule: a non-empty ``image`` field of at most 64 characters names another row's index."""
    return 0 < len(value.strip()) <= IMAGE_REF_MAX_LEN


def decode_b64(value: str) -> bytes:
    """Strict base64 decoding (whitespace tolerated); raises ``ValueError`` with a short reason."""
    text = "".join(value.split())
    if not text:
        raise ValueError("empty image field")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"invalid base64 ({e})") from e


def blank(value: Any) -> bool:
    """A missing TSV/JSON value: ``None``, an empty string, or pandas' ``nan`` written as text."""
    return value is None or (isinstance(value, str) and value.strip() in {"", "nan", "NaN"})
