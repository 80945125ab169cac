"""``python -m harness.commands.paired_quality BASELINE RUN [RUN ...]``: each run's quality against the baseline
run on the same samples, with paired 95 % bootstrap intervals (:mod:`harness.metrics.paired`, issue 31).

Prints one markdown table (run, metric, mean, baseline mean, delta [interval], Wilcoxon p, verdict — ``n.s.``
when the interval contains 0 —, pairs, invalid outputs run / baseline) and writes it as JSON with ``--out``.
A run's label is its directory name and the technique its ``summary.json`` names (VisionZip method and keep,
SERE k, ``moe.top_k`` / ``moe.routing``). Runs must share requests (same dataset and limit): samples are
matched by uid, and those in one run only are counted as ``unmatched``.

Example: ``python -m harness -m visionzip.method=attention,random,pool,first visionzip.keep=0.5`` and a baseline
run, then ``python -m harness.commands.paired_quality BASE multirun/0 multirun/1 multirun/2 multirun/3``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.metrics.paired import paired_metrics, read_samples


def technique_label(run_dir: Path) -> str:
    """``visionzip=random@0.5``, ``sere.k=2``, ``moe.routing=random_p``… from the run's summary.json."""
    try:
        cfg = json.loads((run_dir / "summary.json").read_text(encoding="utf-8")).get("config") or {}
    except (OSError, ValueError):
        return ""
    parts = []
    vz, sere, moe = cfg.get("visionzip") or {}, cfg.get("sere") or {}, cfg.get("moe") or {}
    if float(vz.get("keep", 1.0)) < 1.0:
        parts.append(f"visionzip={vz.get('method', 'attention')}@{vz['keep']}")
    if sere.get("k") is not None:
        parts.append(f"sere.k={sere['k']} rho={sere.get('rho')}")
    if moe.get("top_k") is not None:
        parts.append(f"moe.top_k={moe['top_k']}")
    if moe.get("routing"):
        knob = f"k={moe.get('k_primary')}" if moe["routing"] == "random_p" else f"p={moe.get('p')}"
        parts.append(f"moe.routing={moe['routing']} {knob}")
    return " ".join(parts) or "baseline"


def compare(baseline: Path, runs: Sequence[Path], metrics: Sequence[str] | None = None,
            **kw: Any) -> list[dict[str, Any]]:
    """One entry per run: its label, its directory and :func:`paired_metrics` against ``baseline``."""
    base = read_samples(baseline)
    return [{"run": str(r), "label": technique_label(r), **paired_metrics(read_samples(r), base, metrics, **kw)}
            for r in runs]


def _f(v: Any) -> str:
    return "—" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["| run | technique | metric | mean | baseline | delta [95 % paired CI] | p (Wilcoxon) | verdict | pairs "
             "| invalid run / baseline |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        for name, m in row["metrics"].items():
            lines.append(f"| {Path(row['run']).name} | {row['label']} | {name} | {_f(m['mean_a'])} | {_f(m['mean_b'])} "
                         f"| {_f(m['delta'])} [{_f(m['low'])}, {_f(m['high'])}] | {_f(m['p_wilcoxon'])} "
                         f"| {m['verdict']} | {m['n']} | {row['invalid_a']} / {row['invalid_b']} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.commands.paired_quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("baseline", help="the baseline run directory (its samples.jsonl)")
    ap.add_argument("runs", nargs="+", help="run directories compared with the baseline on the same samples")
    ap.add_argument("--metric", action="append", help="a per-sample score key (repeatable; default: every numeric one)")
    ap.add_argument("--n-resamples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap generator's seed")
    ap.add_argument("--out", help="also write the comparison as JSON here")
    args = ap.parse_args(argv)
    rows = compare(Path(args.baseline), [Path(r) for r in args.runs], args.metric,
                   n_resamples=args.n_resamples, seed=args.seed)
    print(markdown(rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"baseline": args.baseline, "seed": args.seed, "runs": rows}, indent=1),
                                  encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
