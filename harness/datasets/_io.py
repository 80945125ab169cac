"""Reading helpers shared by the loaders: every fault of a *file* is one :class:`DatasetError` naming the file,
the line where there is one, and the config key that points at the file (exit 2 before the model loads).

* :func:`data_path` / :func:`image_root_of`: config paths resolved from the working directory, with errors
  that name the config key (:func:`config_key`: ``dataset.path`` or ``dataset.sources.<tag>.path``).
* :func:`read_lines`: UTF-8 lines decoded one by one, so a non-UTF-8 byte is reported with its line.
* :func:`iter_json_rows`: a JSON array or JSON Lines file, row by row with each row's line.
* :func:`iter_tsv`: VLMEvalKit TSVs read row by row with the ``csv`` module (tab-separated, fields with
  newlines quoted, BOM dropped), the field size limit raised for base64 images; a row with the wrong number
  of fields is flagged for its loader (a row fault), not raised.
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


def config_key(cfg: Any, field: str) -> str:
    """The config key a user sets for ``field`` of this dataset: ``dataset.<field>``, or
    ``dataset.sources.<tag>.<field>`` for a source of a mix (the mix sets ``config_key`` on its sources)."""
    return f"{cfg_get(cfg, 'config_key', 'dataset')}.{field}"


def _user_path(raw: Any, root: Path, key: str) -> Path:
    if not isinstance(raw, (str, Path)):
        raise DatasetError(f"{key} must be a path, got {raw!r}")
    if "\x00" in str(raw):
        raise DatasetError(f"{key}={str(raw)!r} contains a NUL byte")
    path = Path(raw).expanduser()
    return path if path.is_absolute() else root / path


def data_path(cfg: Any, root: Path, *, file_only: bool = False) -> Path:
    """The configured data file (or folder, unless ``file_only``), relative paths from ``root``.

    Missing, not set, a NUL byte in it, or a folder where a file belongs → :class:`DatasetError` naming the
    config key."""
    key = config_key(cfg, "path")
    raw = cfg_get(cfg, "path")
    if not raw:
        raise DatasetError(f"{key} is not set for dataset {cfg_get(cfg, 'name', '?')!r}")
    path = _user_path(raw, root, key)
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path} (set by {key})")
    if file_only and not path.is_file():
        raise DatasetError(f"{path} is a folder, not a data file (set by {key}; name the .jsonl file itself)")
    return path


def image_root_of(cfg: Any, root: Path, default: Path) -> Path:
    """The configured image root (default ``default``), which must be a folder."""
    key = config_key(cfg, "image_root")
    raw = cfg_get(cfg, "image_root")
    image_root = _user_path(raw, root, key) if raw else default
    if not image_root.is_dir():
        what = "is a file, not a folder" if image_root.is_file() else "not found"
        raise DatasetError(f"image root {what}: {image_root} (set by {key})")
    return image_root


def _raise_csv_field_limit() -> None:
    limit = sys.maxsize
    while True:
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:  # C long is 32-bit on some platforms
            limit //= 10


def _open_binary(path: Path, key: str):
    try:
        return open(path, "rb")
    except IsADirectoryError as e:
        raise DatasetError(f"{path} is a folder, not a data file (set by {key})") from e
    except OSError as e:
        raise DatasetError(f"{path}: cannot be read: {e.strerror or e} (set by {key})") from e


def _not_utf8(path: Path, lineno: int, err: UnicodeDecodeError, key: str) -> DatasetError:
    return DatasetError(f"{path}:{lineno}: not UTF-8 text (byte 0x{err.object[err.start]:02x} at column "
                        f"{err.start + 1}); re-save the file as UTF-8 (set by {key})")



def read_lines(path: Path, key: str) -> Iterator[tuple[int, str]]:
    """``(line number from 1, text)`` of a UTF-8 file (a BOM on line 1 is dropped), line endings kept.

    Each line is decoded on its own so that bytes that are not UTF-8 stop the run with the file, the line
    and the column; a folder or an unreadable file is a :class:`DatasetError` too."""
    with _open_binary(path, key) as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _not_utf8(path, lineno, e, key) from e


def _empty(path: Path, key: str) -> DatasetError:
    return DatasetError(f"{path} is empty: no rows (set by {key})")


def iter_tsv(path: Path, required_columns: tuple[str, ...], key: str = "dataset.path"
             ) -> Iterator[tuple[int, int, dict[str, str], str | None]]:
    """Stream ``(row number, line number, row, column fault)`` from a VLMEvalKit TSV.

    Row numbers count data rows from 1 (the header is row 0); the line is the file line on which the row
    starts (they differ after a quoted field with a newline). ``column fault`` is None, or a message when
    the row has fewer or more fields than the header (the ``csv`` module fills a short row with ``None`` and
    puts extra fields under the key ``None``): a fault of that row, which the loader records. A missing
    header column, an empty file, a header without rows and malformed quoting are :class:`DatasetError`\\ s
    naming the file, the line and ``key``."""
    _raise_csv_field_limit()
    lines = (text for _, text in read_lines(path, key))
    reader = csv.DictReader(lines, delimiter="\t")
    try:
        header = reader.fieldnames or []
    except csv.Error as e:
        raise DatasetError(f"{path}:1: malformed TSV header: {e} (set by {key})") from e
    if not header:
        raise _empty(path, key)
    missing = [c for c in required_columns if c not in header]
    if missing:
        hint = " (is it a tab-separated file?)" if len(header) == 1 else ""
        raise DatasetError(f"{path}:1: header has no column {missing[0]!r}{hint} (columns: {header[:12]}; "
                           f"set by {key})")
    n, line = 0, reader.line_num + 1
    try:
        for n, row in enumerate(reader, start=1):
            fault = None
            if None in row:
                fault = f"has {len(header) + len(row[None])} fields, the header has {len(header)}"
                row = {k: v for k, v in row.items() if k is not None}
            elif any(v is None for v in row.values()):
                fault = f"has {sum(v is not None for v in row.values())} fields, the header has {len(header)}"
            yield n, line, row, fault
            line = reader.line_num + 1
    except csv.Error as e:
        raise DatasetError(f"{path}:{reader.line_num}: malformed TSV: {e} (set by {key})") from e
    if n == 0:
        raise DatasetError(f"{path} has a header but no data rows (set by {key})")


def iter_json_rows(path: Path, key: str = "dataset.path") -> Iterator[tuple[int, int, Any]]:
    """``(position from 0, line number, row)`` from a JSON array file or a JSON Lines file.

    The layout is the first non-blank character's (``[``: one array). Anything that is not JSON, not UTF-8,
    an empty file or an empty array is a :class:`DatasetError` naming the file, the line and ``key``; a row
    that parses but is not an object is the loader's business (a row fault)."""
    with _open_binary(path, key) as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()
    if not head:
        raise _empty(path, key)
    if head.startswith(b"["):
        with _open_binary(path, key) as f:
            data = f.read()
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            col = e.start - (data.rfind(b"\n", 0, e.start) + 1)
            raise DatasetError(f"{path}:{line}: not UTF-8 text (byte 0x{data[e.start]:02x} at column {col + 1}); "
                               f"re-save the file as UTF-8 (set by {key})") from e
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{e.lineno}: not valid JSON: {e.msg} at column {e.colno} "
                               f"(set by {key})") from e
        if not isinstance(rows, list) or not rows:
            raise DatasetError(f"{path}: the JSON array holds no rows (set by {key})")
        line_of = _array_item_lines(text, len(rows))
        for pos, row in enumerate(rows):
            yield pos, line_of[pos], row
        return
    pos = 0
    for lineno, line in read_lines(path, key):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            hint = (" (a JSON Lines file holds one JSON object per line; a JSON array file starts with '[')"
                    if pos == 0 else "")
            raise DatasetError(f"{path}:{lineno}: not valid JSON: {e.msg} at column {e.colno}{hint} "
                               f"(set by {key})") from e
        yield pos, lineno, row
        pos += 1
    if pos == 0:
        raise _empty(path, key)


def _array_item_lines(text: str, n: int) -> list[int]:
    """The line on which each of the ``n`` items of a top-level JSON array starts (for messages), counted
    incrementally so a large array costs one extra pass."""
    decoder, lines, i = json.JSONDecoder(), [], text.index("[") + 1
    line, counted = 1, 0
    for _ in range(n):
        while text[i] in " \t\r\n,":
            i += 1
        line += text.count("\n", counted, i)
        counted = i
        lines.append(line)
        _, i = decoder.raw_decode(text, i)
    return lines


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
