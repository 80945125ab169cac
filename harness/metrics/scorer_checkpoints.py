"""The committed trained scorer encoders (``scoring=default``): where they live and how they are checked.

Why: the embedded random-init stand-ins of :mod:`harness.metrics.tiny_encoders` make ``clip_score``,
``alignment`` and their ``comprehensive`` mean meaningless. The two checkpoints here are the same tiny
architectures **trained on the project's synthetic RAG-IGBench data** (``python -m harness.commands.train_scorers``,
:mod:`harness.metrics.scorer_training`), so on the embedded model's data those scores respond to answer quality
(docs/scoring.md, "What the trained scorers measure"). They do not depend on the embedded VLM: only on the data
generator (:mod:`harness.datasets.synthetic.tasks`), whose version each checkpoint records.

As the embedded model's checkpoint (:mod:`harness.models.trained`), each directory's ``harness_model.json``
records ``"weights": "trained-synthetic"`` (what ``summary.json`` ``run.scoring.clip_weights`` /
``embed_weights`` then say), the training configuration and measurements, and the SHA-256 of every weight file;
:func:`verify_checkpoint` checks them before a scorer loads the directory, so a corrupt or half-copied file fails
loudly instead of scoring silently wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.models.tiny import MARKER
from harness.models.trained import sha256_file  # one hash rule for every committed checkpoint

#: ``run.scoring.clip_weights`` / ``embed_weights`` of these checkpoints (the embedded model's label too)
WEIGHTS_LABEL = "trained-synthetic"
CHECKPOINT_DIR = Path(__file__).parent / "checkpoints"
CLIP_CHECKPOINT = CHECKPOINT_DIR / "tiny-clip-trained-synthetic"
EMBEDDER_CHECKPOINT = CHECKPOINT_DIR / "tiny-text-embedder-trained-synthetic"
#: the weight files whose SHA-256 a checkpoint records (relative paths)
CLIP_WEIGHT_FILES = ("model.safetensors",)
EMBEDDER_WEIGHT_FILES = ("model.safetensors", "2_Dense/model.safetensors")


class ScorerCheckpointError(RuntimeError):
    """A scorer checkpoint's weight file is missing or does not match the SHA-256 its marker records."""


def checkpoint_info(path: str | Path) -> dict[str, Any] | None:
    """The directory's ``harness_model.json``, or None when it has none (a hub id, a foreign checkpoint)."""
    marker = Path(str(path).removeprefix("local-dir:")).expanduser() / MARKER
    try:
        return json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def record_hashes(path: str | Path, files: tuple[str, ...]) -> dict[str, str]:
    """``{relative path: sha256}`` of ``files`` inside ``path`` (what a trained checkpoint's marker records)."""
    return {rel: sha256_file(Path(path) / rel) for rel in files}


def verify_checkpoint(path: str | Path) -> None:
    """Check every weight file a directory's marker lists under ``sha256_files`` against its SHA-256.

    Directories without a marker, or whose marker records no hashes (the random-init stand-ins, user
    checkpoints), pass unchecked: only what this project trained and committed carries hashes to check.
    """
    info = checkpoint_info(path)
    if not info or not info.get("sha256_files"):
        return
    root = Path(str(path).removeprefix("local-dir:")).expanduser()
    for rel, want in info["sha256_files"].items():
        f = root / rel
        if not f.is_file():
            raise ScorerCheckpointError(f"{f}: missing (the scorer checkpoint records its SHA-256 {want[:12]}…); "
                                        "python -m harness.commands.train_scorers rebuilds it")
        got = sha256_file(f)
        if got != want:
            raise ScorerCheckpointError(f"{f}: SHA-256 {got} does not match the recorded {want}")
