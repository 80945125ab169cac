"""Regenerate the bundled ``*_sample`` datasets (``harness/datasets/bundled/``) from the held-out split of the
synthetic task suite: ``python -m harness.datasets.synthetic.bundle bundle [ROOT] [--generator 1|2]`` (the old
``python -m harness.datasets.synthetic.tasks bundle`` still works and lands here).

Why a module of its own: the writers of the three samples (``synthetic``: RAG-IGBench, ``synthetic_ocr_cc``:
OCRBench and CCBench) draw their items from ``synthetic_tasks``; with ``bundle`` inside ``synthetic_tasks`` the
three modules imported one another (``shared/notes/layout.md``: ``datasets/synthetic/bundle``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from harness.datasets.synthetic.rag_igbench import make_rag_igbench_sample
from harness.datasets.synthetic.ocr_cc import make_ccbench_sample, make_ocrbench_sample
from harness.datasets.synthetic.tasks import generator_version, use_generator

__all__ = ["bundle", "main"]


def bundle(root: str | None = None, version: str | None = None) -> list:
    """Regenerate the three bundled ``*_sample`` datasets from the held-out split of generator ``version``
    (default: the active one) and record that version in ``GENERATOR``; returns their data files."""
    base = Path(root) if root else Path(__file__).resolve().parents[1] / "bundled"
    if version is not None:
        use_generator(version)
    base.mkdir(parents=True, exist_ok=True)
    (base / "GENERATOR").write_text(generator_version() + "\n", encoding="utf-8")
    for name in ("rag_igbench_sample/images", "ocrbench_sample/images"):
        shutil.rmtree(base / name, ignore_errors=True)  # no stale images of an older generator
    return [make_rag_igbench_sample(base / "rag_igbench_sample"), make_ocrbench_sample(base / "ocrbench_sample"),
            make_ccbench_sample(base / "ccbench_sample")]


def main(argv: list[str] | None = None, prog: str = "harness.datasets.synthetic.bundle") -> int:
    """``bundle [ROOT] [--generator 1|2]``: regenerate and print the data files written."""
    args = list(sys.argv[1:] if argv is None else argv)
    version = None
    if "--generator" in args:
        i = args.index("--generator")
        version = args[i + 1]
        del args[i:i + 2]
    if args[:1] != ["bundle"]:
        raise SystemExit(f"usage: python -m {prog} bundle [ROOT] [--generator 1|2]")
    for path in bundle(*args[1:2], version=version):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
