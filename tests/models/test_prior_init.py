"""``--init v4`` after v4 stopped being the committed model: its files come back from git history, hash-checked."""

from __future__ import annotations

import subprocess

import pytest

from harness.models import prior_init


def _has_v4_commit() -> bool:
    probe = subprocess.run(["git", "-C", str(prior_init.ROOT), "cat-file", "-e", f"{prior_init.V4_COMMIT}^{{commit}}"],
                           capture_output=True)
    return probe.returncode == 0


needs_history = pytest.mark.skipif(not _has_v4_commit(), reason="no git history with the v4 commit (shallow clone or "
                                                                 "a copy of the working tree)")


@needs_history
def test_v4_files_come_back_from_git_and_hash_to_v4(tmp_path):
    out = tmp_path / "v4"
    got = prior_init.resolve(out)
    assert prior_init._is_v4(got)
    if got == out:  # the committed model is no longer v4: every file the fine-tune loads is there
        assert all((out / name).is_file() for name in prior_init.CHECKPOINT_FILES)
        assert not (tmp_path / "v4.partial").exists()


def test_wrong_weights_are_not_taken_for_v4(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not v4")
    assert not prior_init._is_v4(tmp_path)
    assert not prior_init._is_v4(tmp_path / "missing")


@needs_history
def test_a_bad_commit_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(prior_init, "V4_COMMIT", "0000000")
    with pytest.raises(prior_init.PriorUnavailable):
        prior_init._from_git(tmp_path / "v4")
    assert not (tmp_path / "v4").exists() and not (tmp_path / "v4.partial").exists()


def _has_commit(commit: str) -> bool:
    probe = subprocess.run(["git", "-C", str(prior_init.ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _has_commit(prior_init.PRIORS["v7c-lr2"][0]), reason="no git history with the v7c-lr2 commit")
def test_v7c_lr2_comes_back_from_git_for_v7d(tmp_path):
    """Recipe v7d starts from v7c-lr2 (``--init v7c-lr2``): after v7d-mid's adoption its files come from git."""
    from harness.models.train_recipes import VARIANTS

    assert VARIANTS["v7d-mid"]["init"] == "v7c-lr2" and VARIANTS["v7d-mid"]["pointer_layer"] == 2
    out = tmp_path / "v7c"
    got = prior_init.resolve(out, "v7c-lr2")
    assert prior_init._is_prior(got, "v7c-lr2") and not prior_init._is_prior(got, "v4")
    assert all((got / name).is_file() for name in prior_init.CHECKPOINT_FILES)


@pytest.mark.skipif(not _has_commit(prior_init.PRIORS["v7d-mid"][0]), reason="no git history with the v7d-mid commit")
def test_v7d_mid_comes_back_from_git_for_v7g(tmp_path):
    """Recipe v7g (the committed model since session 17) starts from v7d-mid (``--init v7d-mid``): with v7g
    committed, v7d-mid's files come from git, hash-checked."""
    from harness.models.train_recipes import VARIANTS

    assert VARIANTS["v7g"]["init"] == "v7d-mid"
    assert not prior_init._is_prior(prior_init.CHECKPOINT, "v7d-mid")  # the committed checkpoint is another model
    got = prior_init.resolve(tmp_path / "v7d-mid", "v7d-mid")
    assert got != prior_init.CHECKPOINT and prior_init._is_prior(got, "v7d-mid")
    assert all((got / name).is_file() for name in prior_init.CHECKPOINT_FILES)


def test_an_unknown_prior_is_refused(tmp_path):
    with pytest.raises(prior_init.PriorUnavailable, match="no earlier checkpoint"):
        prior_init.resolve(tmp_path, "v9")
