"""Where a ``vllm serve`` start-up went (harness.engines.vllm.server_startup): the phases read from the lines vLLM
logs (its own format strings, filled as vLLM fills them), only from the part of the log one start wrote, absent
where vLLM logged nothing; and a started server's ``describe()`` carries them."""

from __future__ import annotations

from pathlib import Path

from harness.engines.vllm import serve
from harness.engines.vllm.serve import VLLMServer
from harness.engines.vllm.server_startup import startup_phases

# lines as vLLM 0.26 – 0.33 write them (format strings of default_loader.py, gpu_model_runner.py, backends.py,
# monitor.py, v1/engine/core.py; the worker prefix as a multiprocess engine core prints it)
FIRST_START = """\
(EngineCore_DP0 pid=811) INFO 12-05 19:00:17 [default_loader.py:291] Loading weights took 4.87 seconds
(EngineCore_DP0 pid=811) INFO 12-05 19:00:18 [gpu_model_runner.py:2653] Model loading took 57.0662 GiB memory and 6.123456 seconds
(EngineCore_DP0 pid=811) INFO 12-05 19:00:31 [backends.py:548] Dynamo bytecode transform time: 9.71 s
(EngineCore_DP0 pid=811) INFO 12-05 19:01:02 [monitor.py:34] torch.compile takes 41.25 s in total
(EngineCore_DP0 pid=811) INFO 12-05 19:01:09 [monitor.py:92] Initial profiling/warmup run took 3.40 s
(EngineCore_DP0 pid=811) INFO 12-05 19:01:47 [gpu_model_runner.py:3480] Graph capturing finished in 38 secs, took 1.12 GiB
(EngineCore_DP0 pid=811) INFO 12-05 19:01:48 [core.py:210] init engine (profile, create kv cache, warmup model) took 89.65 s (compilation: 41.25 s)
"""
SECOND_START = """\
INFO 12-05 19:05:02 [default_loader.py:291] Loading weights took 4.50 seconds
INFO 12-05 19:05:40 [monitor.py:34] torch.compile took 12.00 s in total
INFO 12-05 19:06:01 [core.py:210] init engine (profile, create kv cache, warmup model) took 40.10 s
"""


def test_phases_of_one_start(tmp_path: Path):
    log = tmp_path / "vllm_serve.log"
    log.write_text("$ vllm serve ...\n" + FIRST_START)
    assert startup_phases(log) == {"weights_s": 4.87, "model_loading_s": 6.123456, "dynamo_s": 9.71,
                                   "torch_compile_s": 41.25, "profile_run_s": 3.40, "cuda_graphs_s": 38.0,
                                   "engine_init_s": 89.65}


def test_a_later_start_reads_only_its_own_part_of_the_log(tmp_path: Path):
    log = tmp_path / "vllm_serve.log"
    log.write_text(FIRST_START)
    offset = log.stat().st_size
    with open(log, "a") as f:
        f.write(SECOND_START)
    # eager or cached: what vLLM did not log is absent, never a zero or the first start's figure
    assert startup_phases(log, offset) == {"weights_s": 4.50, "torch_compile_s": 12.0, "engine_init_s": 40.10}


def test_no_log_no_phases(tmp_path: Path):
    assert startup_phases(None) == {} and startup_phases(tmp_path / "absent.log") == {}


def test_a_start_reads_its_phases_once_from_its_own_part_of_the_log(tmp_path: Path, monkeypatch):
    """``VLLMServer._start_on`` reads the phases when the server is healthy, from the byte where this start's
    output begins (a second start of one run dir appends to the same log), and ``describe()`` reports them."""
    log_dir = tmp_path / "run"
    log_dir.mkdir()
    (log_dir / serve.LOG_NAME).write_text(FIRST_START)      # an earlier start's lines: not this one's

    class Proc:
        def poll(self):
            return None

    def popen(cmd, stdout, **kw):
        stdout.write(SECOND_START.encode())
        stdout.flush()
        return Proc()
    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(VLLMServer, "wait_healthy", lambda self, timeout_s: None)
    server = VLLMServer._start_on("/m", {}, {}, log_dir, 5.0, "127.0.0.1", 1, None)
    assert server.startup_phases == {"weights_s": 4.50, "torch_compile_s": 12.0, "engine_init_s": 40.10}
    assert server.describe()["startup_phases"] == server.startup_phases
    assert VLLMServer("http://127.0.0.1:1").describe()["startup_phases"] == {}   # found running: not ours
