"""Regenerate the bundled ``*_sample`` datasets (``harness/datasets/bundled/``) from the held-out split of the
synthetic task suite: ``python -m harness.datasets.synthetic.bundle bundle [ROOT] [--generator 1|2]`` (the old
``python -m harness.datasets.synthetic.tasks bundle`` still works and lands here). ``heldout ROOT [--n N]`` writes
larger held-out sets (RAG-IGBench rows and CCBench questions, 48 each by default, seed 0): the samples the MoE and
CCBench sensitivity tests run on, for a user to rerun them with ``dataset.path=``.

Why a module of its own: the writers of the three samples (``synthetic``: RAG-IGBench, ``synthetic_ocr_cc``:
OCRBench and CCBench) draw their items from ``synthetic_tasks``; with ``bundle`` inside ``synthetic_tasks`` the
three modules imported one another (``shared/notes/layout.md``: ``datasets/synthetic/bundle``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from harness.datasets.synthetic.rag_igbench import make_rag_igbench_sample, write_rag_igbench
from harness.datasets.synthetic.ocr_cc import make_ccbench_sample, make_ocrbench_sample, write_ccbench
from harness.datasets.synthetic.tasks import generator_version, items, use_generator

__all__ = ["bundle", "heldout", "main"]


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


def heldout(root: str | Path, n: int = 48, seed: int = 0) -> dict[str, Path]:
    """``n`` held-out RAG-IGBench requests (``ROOT/rag/data.jsonl``) and ``n`` CCBench questions
    (``ROOT/mcq/CCBench_sample.tsv``, originals: the loader adds the circular rotations) of the active generator,
    a pure function of (generator, n, seed). Why: 12 bundled requests proved too few to carry a direction between
    two MoE techniques (docs/embedded_model_v7.md §10); the sensitivity tests write these sets at test time."""
    root = Path(root)
    return {"rag": write_rag_igbench(root / "rag", items("rag", "heldout", n, seed)),
            "mcq": write_ccbench(root / "mcq", items("mcq", "heldout", n, seed))}


def main(argv: list[str] | None = None, prog: str = "harness.datasets.synthetic.bundle") -> int:
    """``bundle [ROOT] [--generator 1|2]``: regenerate and print the data files written; ``heldout ROOT [--n N]
    [--generator 1|2]``: the larger held-out sets."""
    ap = argparse.ArgumentParser(prog=f"python -m {prog}", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bundle", help="regenerate the bundled samples (default root: the package's bundled/)")
    b.add_argument("root", nargs="?", default=None)
    h = sub.add_parser("heldout", help="write the held-out RAG-IGBench and CCBench sets the sensitivity tests use")
    h.add_argument("root")
    h.add_argument("--n", type=int, default=48, help="requests / questions per set")
    for p in (b, h):
        p.add_argument("--generator", choices=("1", "2"), default=None, help="task-suite generator version")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "heldout":
        if args.generator is not None:
            use_generator(args.generator)
        paths = list(heldout(args.root, args.n).values())
    else:
        paths = bundle(args.root, version=args.generator)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
