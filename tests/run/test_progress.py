"""harness/run/progress.py: where stderr is not a terminal, one plain line per phase (issue 25, 7)."""

from __future__ import annotations

from harness.run.progress import RunProgress


def test_a_log_gets_one_plain_line_per_phase_and_no_escape_codes(capsys, monkeypatch):
    """Old code: nested tqdm bars wrote cursor-movement escape codes into non-TTY logs."""
    monkeypatch.delenv("HARNESS_PROGRESS", raising=False)
    progress = RunProgress("hf · rag_igbench")
    with progress.phase("generate", total=3) as bar:
        for _ in range(3):
            bar.update(1)
        bar.set_postfix_str("x")
    progress.skip("cache")
    with progress.phase("finish", unit="step"):
        pass
    try:
        with progress.phase("model", unit="step"):
            raise RuntimeError("refused")
    except RuntimeError:
        pass
    progress.close()
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err
    lines = err.splitlines()
    assert lines[0].startswith("hf · rag_igbench: generate ") and lines[0].endswith(", 3 samples")
    assert lines[1] == lines[1].split(",")[0] and lines[1].startswith("hf · rag_igbench: finish ")
    assert lines[-1].startswith("hf · rag_igbench: done in ") and len(lines) == 3  # nothing for the failed phase
    assert set(progress.times) == {"generate", "finish", "model"}
