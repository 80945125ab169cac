"""Earlier committed checkpoints that recipes fine-tune from: v4 for v7–v7c (``--init v4``), v7c-lr2 for v7d
(``--init v7c-lr2``), v7d-mid for v7e–v7g (``--init v7d-mid``; v7g is committed since session 17), once the
committed model is no longer the one they start from. (Named ``v4_init`` until session 15, when it held only v4; the old command name still runs it.)

Why: the v7 family starts from v4's weights, v7d from v7c-lr2's and v7e from v7d-mid's, not from scratch, so "retraining is one
command" needs those files after a later model has been adopted. They are in git history (:data:`PRIORS`: the
commit whose checkpoint directory holds them, and their SHA-256); this module writes them into ``.v4-init/`` /
``.<name>-init/`` at the repository root (git-ignored) and checks the hash. On a machine without the history (the
GPU machine gets a copy of the working tree, not ``.git``), run ``python -m harness.models.prior_init [--name NAME]``
beforehand where the history is and carry that folder with the call.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from harness.models.train_recipes import V4_SHA256, V7C_LR2_SHA256, V7D_MID_SHA256
from harness.models.trained import sha256_file, CHECKPOINT, CHECKPOINT_FILES

#: the commit that adopted v4 (its checkpoint directory holds exactly the v4 files)
V4_COMMIT = "d258951"
#: name -> (a commit whose checkpoint directory holds that model, the SHA-256 of its model.safetensors)
PRIORS = {"v4": (V4_COMMIT, V4_SHA256),
          "v7c-lr2": ("13be763", V7C_LR2_SHA256),  # the last commit before v7d-mid's adoption
          "v7d-mid": ("106f496", V7D_MID_SHA256)}  # the commit that adopted v7d-mid
ROOT = Path(__file__).resolve().parents[2]
INIT_DIR = ROOT / ".v4-init"


class PriorUnavailable(RuntimeError):
    """Neither the committed checkpoint, nor the init folder, nor git history holds the prior's weights."""


def init_dir(name: str = "v4") -> Path:
    """Where ``name``'s files are written (git-ignored): ``.v4-init/``, ``.v7c-lr2-init/``."""
    return INIT_DIR if name == "v4" else ROOT / f".{name}-init"


def _is_prior(directory: Path, name: str) -> bool:
    weights = directory / "model.safetensors"
    return weights.is_file() and sha256_file(weights) == PRIORS[name][1]


def _is_v4(directory: Path) -> bool:
    return _is_prior(directory, "v4")


def _from_git(out: Path, name: str = "v4") -> None:
    commit = V4_COMMIT if name == "v4" else PRIORS[name][0]  # (V4_COMMIT read here: tests patch it)
    rel = CHECKPOINT.relative_to(ROOT).as_posix()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for file in CHECKPOINT_FILES:
        blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{rel}/{file}"], capture_output=True)
        if blob.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PriorUnavailable(f"git show {commit}:{rel}/{file} failed: {blob.stderr.decode().strip()[:200]}")
        (tmp / file).write_bytes(blob.stdout)
    if not _is_prior(tmp, name):
        shutil.rmtree(tmp, ignore_errors=True)
        raise PriorUnavailable(f"the weights at {commit} do not hash to {name}'s SHA-256")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def resolve(out: Path | None = None, name: str = "v4") -> Path:
    """A directory with ``name``'s checkpoint: the committed one while it is that model, else ``out`` (default
    :func:`init_dir`; written from git once)."""
    if name not in PRIORS:
        raise PriorUnavailable(f"no earlier checkpoint named {name!r}; known: {', '.join(PRIORS)}")
    out = init_dir(name) if out is None else out
    if _is_prior(CHECKPOINT, name):
        return CHECKPOINT
    if not _is_prior(out, name):
        try:
            _from_git(out, name)
        except (OSError, subprocess.SubprocessError) as e:  # no git binary, not a repository
            raise PriorUnavailable(f"cannot read git history: {e}") from e
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--name", choices=sorted(PRIORS), default="v4")
    ap.add_argument("--out", type=Path, default=None, help="default: .v4-init / .<name>-init at the repository root")
    args = ap.parse_args(argv)
    try:
        print(resolve(args.out, args.name))
    except PriorUnavailable as e:
        raise SystemExit(f"{args.name} weights unavailable: {e}") from e
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
