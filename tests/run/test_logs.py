"""harness/run/logs.py and the console summary: a quiet console (issue 25, 7)."""

from __future__ import annotations

import io
import logging

from harness.run.logs import run_logging
from harness.run.outcome import console_summary


def test_third_party_chatter_goes_to_the_log_file_not_the_console(tmp_path):
    """Old code: transformers / W&B / vLLM lines reached the console through the root logger."""
    root = logging.getLogger()
    # transformers' own logging (set up when any earlier test imported it) stops its logger propagating: the
    # test sets the state it checks is restored, whatever ran before it on this worker
    names = ("transformers", "transformers.modeling_utils", "wandb", "vllm", "vllm.engine")
    saved = {n: logging.getLogger(n).propagate for n in names}
    for n in names:
        logging.getLogger(n).propagate = True
    console_stream = io.StringIO()
    console = logging.StreamHandler(console_stream)
    console.setLevel(logging.WARNING)
    log_file = logging.FileHandler(tmp_path / "cli.log", encoding="utf-8")  # as Hydra's job logging sets up
    root.addHandler(console)
    root.addHandler(log_file)
    try:
        with run_logging(tmp_path):
            for name in ("transformers.modeling_utils", "wandb", "vllm.engine"):
                logging.getLogger(name).warning("chatter from %s", name)
            logging.getLogger("harness.run").warning("a warning of the run")
        logging.getLogger("transformers").warning("after the run")  # restored: propagates again
    finally:
        root.removeHandler(console)
        root.removeHandler(log_file)
        log_file.close()
        for n, propagate in saved.items():
            logging.getLogger(n).propagate = propagate
    shown = console_stream.getvalue()
    assert "chatter" not in shown and "a warning of the run" in shown and "after the run" in shown
    text = (tmp_path / "cli.log").read_text(encoding="utf-8")
    assert all(f"chatter from {n}" in text for n in ("transformers.modeling_utils", "wandb", "vllm.engine"))


def test_console_summary_labels_technique_lines():
    """Old code: `visionzipkeep_rate 0.909` (no space after a 9-letter technique name)."""
    text = console_summary({"run": {"run_dir": "/r"}, "metrics": {}, "latency": {},
                            "visionzip": {"keep_rate": 0.909}, "sere": {"expert_union_before": 8.0,
                                                                         "expert_union_after": 5.0}}, "/r")
    assert "visionzip keep_rate 0.909" in text and "sere     expert_union_before 8.000" in text
