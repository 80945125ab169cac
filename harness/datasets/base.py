"""What every loader produces: samples an engine can run and a scorer can score.

A :class:`Sample` carries the request as ordered chat content (text and image parts, exactly as the
benchmark interleaves them), its images as lazily decoded :class:`ImageInput` objects, and the reference
the scorer needs. A sample that cannot be used (missing or corrupt image, a defective row) is still returned, with ``error``
(the message: file, line, field) and ``error_reason`` (a stable code of :data:`harness.datasets.faults.REASONS`)
set: the run records it as a *data* error, scores it 0 and counts it, so nothing silently leaves the averages.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class DatasetError(ValueError):
    """A data file or row that cannot be read at all (the message names the file, row and field)."""


class ImageLoadError(RuntimeError):
    """An image that is missing, truncated or undecodable (``reason``: ``image_missing`` | ``image_undecodable``)."""

    def __init__(self, message: str, reason: str = "image_undecodable"):
        super().__init__(message)
        self.reason = reason


class PathEscapeError(DatasetError):
    """A path inside a data file that would resolve outside the configured data root."""


def resolve_under(root: str | Path, relative: str) -> Path:
    """Resolve ``relative`` inside ``root``, refusing anything that escapes it.

    Absolute paths, ``..`` components and symlinks that point outside ``root`` are rejected: a data
    file must not be able to make the harness read arbitrary files of the machine.
    """
    if not isinstance(relative, str) or not relative.strip():
        raise PathEscapeError(f"image path {relative!r} is not a non-empty string")
    if "\x00" in relative:
        raise PathEscapeError(f"image path {relative!r} contains a NUL byte")
    root_real = Path(os.path.realpath(root))
    if os.path.isabs(relative) or relative.startswith(("~", "\\")):
        raise PathEscapeError(f"absolute path {relative!r} in data file; paths must be relative to {root}")
    candidate = Path(os.path.realpath(root_real / relative))
    if candidate != root_real and root_real not in candidate.parents:
        raise PathEscapeError(f"path {relative!r} resolves outside the data root {root}")
    return candidate


@dataclass
class ImageInput:
    """One image of a request: a local file or encoded bytes, plus the tag of the dataset it came from.

    Decoding is lazy so that loading a 6k-row benchmark does not hold 80k images in memory; ``load``
    fully decodes (``Image.load``) so a truncated file fails here, not inside the engine.
    """

    source: str
    path: Path | None = None
    data: bytes | None = None
    key: str = ""  # URL or id the image had in the data file, for error messages

    def load(self):
        from PIL import Image, UnidentifiedImageError

        try:
            if self.data is not None:
                img = Image.open(io.BytesIO(self.data))
            elif self.path is not None:
                img = Image.open(self.path)
            else:
                raise ImageLoadError(f"image {self.key!r} has neither a file nor data", "image_missing")
            img.load()
            return img.convert("RGB")
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise ImageLoadError(f"image file missing: {self.path} (from {self.key!r})", "image_missing") from e
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError) as e:
            raise ImageLoadError(f"image {self.key or self.path} cannot be decoded: {e}") from e


@dataclass
class Sample:
    """One request of a benchmark, ready for an engine and a scorer."""

    uid: str  # unique within the run (position-based where upstream ids collide)
    dataset: str  # dataset name (registry key)
    task: str  # which scorer applies: "rag_igbench" | "ocrbench" | "mcq"
    content: list[dict[str, Any]]  # ordered parts: {"type": "text", "text": s} | {"type": "image", "index": i}
    images: list[ImageInput] = field(default_factory=list)
    reference: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    error_reason: str | None = None  # set for data errors: a key of harness.datasets.faults.REASONS

    def load_images(self) -> list:
        """Decoded images in request order; raises :class:`ImageLoadError` naming the bad one.

        A bad image is the data's fault: ``error_reason`` is set to its reason before the error propagates,
        so the run records the sample as a data error."""
        try:
            return [img.load() for img in self.images]
        except ImageLoadError as e:
            self.error_reason = self.error_reason or e.reason
            raise
