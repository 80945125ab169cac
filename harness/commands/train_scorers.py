"""Retrain the committed scorer encoders of ``scoring=default``: ``python -m harness.commands.train_scorers``.

Why a command: the tiny CLIP and text embedder behind RAG-IGBench's ``clip_score`` and ``alignment`` on the
embedded data (:mod:`harness.metrics.scorer_checkpoints`) are artefacts of the synthetic data generator; when the
generator changes, they are retrained with this one command (CPU, seeded; about 5-10 minutes on two shared
cores) and the result committed. It never reads the embedded VLM, so retraining the VLM needs no rerun.

    python -m harness.commands.train_scorers                 # both, into harness/metrics/checkpoints/
    python -m harness.commands.train_scorers --out DIR       # elsewhere (scoring.clip_model=transformers:DIR/…)
    python -m harness.commands.train_scorers --only embed    # one of them
    python -m harness.commands.train_scorers --check         # re-measure the committed ones, train nothing

It prints the held-out figures written into each checkpoint's ``harness_model.json`` (docs/scoring.md, "What the
trained scorers measure", has the table).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.metrics import scorer_training as st
from harness.metrics.scorer_checkpoints import (
    checkpoint_info, verify_checkpoint, CHECKPOINT_DIR, CLIP_CHECKPOINT, EMBEDDER_CHECKPOINT)


def _summary(name: str, info: dict) -> str:
    lines = [f"{name}: {info.get('name')}  ({info.get('n_parameters')} parameters, {info.get('train_seconds')} s, "
             f"loss {info.get('loss_first', float('nan')):.4g} → {info.get('loss_last', float('nan')):.4g})"]
    lines += [f"  {k:32s} {v}" for k, v in (info.get("heldout") or {}).items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.commands.train_scorers", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=CHECKPOINT_DIR,
                   help=f"folder of the two checkpoint directories (default: the committed {CHECKPOINT_DIR})")
    p.add_argument("--only", choices=("clip", "embed"), help="train one of the two")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true",
                   help="verify the SHA-256 of the committed checkpoints and re-measure them on held-out items")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    cfg = st.TrainConfig(seed=args.seed)
    if args.check:
        for name, path, measure in (("clip", CLIP_CHECKPOINT, st.evaluate_clip),
                                    ("embed", EMBEDDER_CHECKPOINT, st.evaluate_embedder)):
            if args.only and args.only != name:
                continue
            verify_checkpoint(path)
            recorded = (checkpoint_info(path) or {}).get("heldout")
            print(f"{name}: {path} (SHA-256 ok)\n  recorded {json.dumps(recorded)}\n  measured "
                  f"{json.dumps(measure(path, cfg))}")
        return 0
    done = st.train_all(args.out, cfg, progress=not args.no_progress,
                        only=lambda name: args.only in (None, name))
    for name, info in done.items():
        print(_summary(name, info))
    if args.out.resolve() == CHECKPOINT_DIR.resolve():
        print("commit: git add harness/metrics/checkpoints && git commit -m 'scorers retrained'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
