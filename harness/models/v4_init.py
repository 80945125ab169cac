"""The v4 checkpoint that recipes v7–v7c fine-tune from (``--init v4``), once the committed model is no longer v4.

Why: the v7 family starts from v4's weights, not from scratch, so "retraining is one command" needs v4's files
after a v7 model has been adopted. They are in git history (commit ``V4_COMMIT``); this module writes them into
``.v4-init/`` at the repository root (git-ignored) and checks their SHA-256 against ``train_recipes.V4_SHA256``.
On a machine without the history (the GPU machine gets a copy of the working tree, not ``.git``), run
``python -m harness.models.v4_init`` beforehand where the history is and carry ``.v4-init`` with the call.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from harness.models.train_recipes import V4_SHA256
from harness.models.trained import sha256_file, CHECKPOINT, CHECKPOINT_FILES

#: the commit that adopted v4 (its checkpoint directory holds exactly the v4 files)
V4_COMMIT = "d258951"
ROOT = Path(__file__).resolve().parents[2]
INIT_DIR = ROOT / ".v4-init"


class V4Unavailable(RuntimeError):
    """Neither the committed checkpoint, nor ``.v4-init/``, nor git history holds the v4 weights."""


def _is_v4(directory: Path) -> bool:
    weights = directory / "model.safetensors"
    return weights.is_file() and sha256_file(weights) == V4_SHA256


def _from_git(out: Path) -> None:
    rel = CHECKPOINT.relative_to(ROOT).as_posix()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in CHECKPOINT_FILES:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{V4_COMMIT}:{rel}/{name}"], capture_output=True)
        if blob.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise V4Unavailable(f"git show {V4_COMMIT}:{rel}/{name} failed: {blob.stderr.decode().strip()[:200]}")
        (tmp / name).write_bytes(blob.stdout)
    if not _is_v4(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
        raise V4Unavailable(f"the weights at {V4_COMMIT} do not hash to V4_SHA256")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def resolve(out: Path = INIT_DIR) -> Path:
    """A directory with the v4 checkpoint: the committed one while it is v4, else ``out`` (written from git once)."""
    if _is_v4(CHECKPOINT):
        return CHECKPOINT
    if not _is_v4(out):
        try:
            _from_git(out)
        except (OSError, subprocess.SubprocessError) as e:  # no git binary, not a repository
            raise V4Unavailable(f"cannot read git history: {e}") from e
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=INIT_DIR)
    args = ap.parse_args(argv)
    try:
        print(resolve(args.out))
    except V4Unavailable as e:
        raise SystemExit(f"v4 weights unavailable: {e}") from e
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
