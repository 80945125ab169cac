"""OCRBench's Hugging Face image cells that name a file (``{bytes: null, path}``) stay inside the data root
(issue 26): an absolute path, a ``..`` escape or a link out is the row's ``bad_image_path`` fault, scored and
counted like every other defective row, and the file it names is never read."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from harness.config.schema import DatasetConfig
from harness.datasets import load_samples
from harness.datasets import ocrbench
from harness.datasets.ocrbench import hf_row_to_sample

QUESTION = {"question": "what is written in the image?", "question_type": "Regular Text Recognition",
            "answer": ["HARBOR"], "dataset": "IIIT5K"}


def png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path]:
    """``(data root with images/ok.png, a secret file outside it)``."""
    root = tmp_path / "ocrbench_hf"
    (root / "images").mkdir(parents=True)
    (root / "images/ok.png").write_bytes(png())
    secret = tmp_path / "secret.png"
    secret.write_bytes(png())
    return root, secret


def row(path: object) -> dict:
    return {**QUESTION, "image": {"bytes": None, "path": path}}


@pytest.mark.parametrize("path,says", [
    ("ABSOLUTE", "absolute path"),
    ("../secret.png", "resolves outside the data root"),
    ("images/../../secret.png", "resolves outside the data root"),
    ("LINK", "resolves outside the data root"),
    ("images/ok\x00.png", "NUL byte"),
    ("", "not a non-empty string"),
    (7, "not a non-empty string"),
])
def test_a_path_cell_leaving_the_data_root_is_a_counted_row_fault(layout, path, says):
    root, secret = layout
    if path == "ABSOLUTE":
        path = str(secret)
    elif path == "LINK":
        (root / "images/link.png").symlink_to(secret)
        path = "images/link.png"
    s = hf_row_to_sample(3, row(path), str(root), "ocrbench", root)
    assert s.error_reason == "bad_image_path", (s.error_reason, s.error)
    assert says in s.error and "row 3" in s.error and "\n" not in s.error
    assert s.images == [] and s.content == []  # nothing of the secret file reaches a request
    assert s.reference["type"] == "Regular Text Recognition"  # still counted in its type's accuracy


def test_a_path_cell_without_a_data_root_is_refused(layout):
    root, _ = layout
    s = hf_row_to_sample(0, row("images/ok.png"), str(root), "ocrbench")
    assert s.error_reason == "bad_image_path" and "no data root" in s.error


def test_a_path_cell_inside_the_data_root_loads_and_a_missing_one_is_image_missing(layout):
    root, _ = layout
    ok = hf_row_to_sample(0, row("images/ok.png"), str(root), "ocrbench", root)
    assert ok.error is None and ok.load_images()[0].size == (8, 8)
    gone = hf_row_to_sample(1, row("images/gone.png"), str(root), "ocrbench", root)
    assert gone.error_reason == "image_missing" and "images/gone.png" in gone.error
    with_bytes = hf_row_to_sample(2, {**QUESTION, "image": {"bytes": png(), "path": "/etc/passwd"}}, str(root),
                                  "ocrbench", root)
    assert with_bytes.error is None  # embedded bytes are the image; the path is only their original name


def test_the_loader_resolves_under_the_dataset_folder_or_image_root(layout, tmp_path, monkeypatch):
    """Through ``load_samples``: the default data root is the dataset's folder, ``dataset.image_root`` moves
    it; the rows come from a stub of the ``datasets`` reader so this runs without that library."""
    root, secret = layout
    (root / "test-00000-of-00001.parquet").write_bytes(b"PAR1")
    rows = [row("images/ok.png"), row(str(secret)), row("../secret.png")]
    monkeypatch.setattr(ocrbench, "_hf_dataset", lambda path, split: rows)
    samples = list(load_samples(DatasetConfig(name="ocrbench", path=str(root), format="hf"), tmp_path))
    assert [s.error_reason for s in samples] == [None, "bad_image_path", "bad_image_path"]
    rows[:] = [row("ok.png"), row("../test-00000-of-00001.parquet")]  # the second leaves images/
    moved = list(load_samples(DatasetConfig(name="ocrbench", path=str(root), format="hf",
                                            image_root=str(root / "images")), tmp_path))
    assert [s.error_reason for s in moved] == [None, "bad_image_path"]


def test_bad_paths_are_counted_by_reason(layout):
    """The run's ``metrics.data_errors`` counts them like every other defective row."""
    from harness.metrics.scoring import data_errors

    root, secret = layout
    samples = [hf_row_to_sample(i, row(p), str(root), "ocrbench", root)
               for i, p in enumerate(["images/ok.png", str(secret), "../secret.png", "images/gone.png"])]
    counts = data_errors([{"error_kind": "data" if s.error else None, "error_reason": s.error_reason}
                                for s in samples])
    assert counts == {"total": 3, "by_reason": {"bad_image_path": 2, "image_missing": 1}}
