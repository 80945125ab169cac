"""``--init v4`` after v4 stopped being the committed model: its files come back from git history, hash-checked."""

from __future__ import annotations

import subprocess

import pytest

from harness.models import v4_init


def _has_v4_commit() -> bool:
    probe = subprocess.run(["git", "-C", str(v4_init.ROOT), "cat-file", "-e", f"{v4_init.V4_COMMIT}^{{commit}}"],
                           capture_output=True)
    return probe.returncode == 0


needs_history = pytest.mark.skipif(not _has_v4_commit(), reason="no git history with the v4 commit (shallow clone or "
                                                                 "a copy of the working tree)")


@needs_history
def test_v4_files_come_back_from_git_and_hash_to_v4(tmp_path):
    out = tmp_path / "v4"
    got = v4_init.resolve(out)
    assert v4_init._is_v4(got)
    if got == out:  # the committed model is no longer v4: every file the fine-tune loads is there
        assert all((out / name).is_file() for name in v4_init.CHECKPOINT_FILES)
        assert not (tmp_path / "v4.partial").exists()


def test_wrong_weights_are_not_taken_for_v4(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"not v4")
    assert not v4_init._is_v4(tmp_path)
    assert not v4_init._is_v4(tmp_path / "missing")


@needs_history
def test_a_bad_commit_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(v4_init, "V4_COMMIT", "0000000")
    with pytest.raises(v4_init.V4Unavailable):
        v4_init._from_git(tmp_path / "v4")
    assert not (tmp_path / "v4").exists() and not (tmp_path / "v4.partial").exists()
