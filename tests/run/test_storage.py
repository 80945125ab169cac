"""Storage and the generation cache's entries (issue 26; docs/crash-safety.md "Storage", docs/bad_data.md
"Generation-cache entries"): a read-only run directory or cache, a full disk, a finished run on read-only media,
invalid cache entries, links planted in shared places, a killed SERE artifact build's temporary file.

The tests run as any user (root included, who writes into a chmod-ed directory anyway): a read-only file system
and a full disk are simulated by making the harness's own file creation (:func:`harness.config.paths.open_new`)
or the cache shard's write raise ``OSError(EROFS / ENOSPC)``, as the kernel would."""

from __future__ import annotations

import errno
import json
import os
import socket
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from harness.config.checks import StorageError
from harness.config.schema import register_configs
from harness.engines import ENGINES
from harness.engines.base import Generation
from harness.run.cache import CACHE_VERSION, GenerationCache, entry_problem

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "harness/datasets/bundled/rag_igbench_sample"


class CountingEngine:
    """Answers ``answer <uid>``; counts the requests it generated (class attribute, reset per test)."""

    name = "counting"
    calls: list[str] = []

    def __init__(self, *args, **kwargs):
        pass

    def generate_batch(self, requests):
        CountingEngine.calls.extend(r.uid for r in requests)
        return [Generation(uid=r.uid, text=f"answer {r.uid}", prompt_tokens=10, output_tokens=5, ttft_ms=1.0,
                           tpot_ms=0.5, e2e_ms=3.0) for r in requests]

    def describe(self):
        return {"engine": "counting", "engine_version": "0", "device": "cpu", "dtype": "float32"}

    def close(self):
        pass


@pytest.fixture
def run(monkeypatch, tmp_path):
    """``run(run_dir, *overrides)``: run_experiment with the counting engine on the bundled RAG-IGBench sample."""
    from harness.run.experiment import run_experiment

    monkeypatch.setitem(ENGINES, "counting", f"{__name__}:CountingEngine")
    CountingEngine.calls = []
    register_configs()

    def go(run_dir: Path, *overrides: str):
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(ROOT / "harness/conf"), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[
                "engine.name=counting", "wandb.mode=disabled", f"dataset.path={SAMPLE / 'data.jsonl'}",
                "model.embedded=false", "model.path=unused", "scoring.clip_model=null", "scoring.embed_model=null",
                f"cache.path={tmp_path / 'cache'}", "engine.warmup=0", *overrides])
        GlobalHydra.instance().clear()
        return run_experiment(cfg, run_dir)

    return go


# --------------------------------------------------------------------------------- cache entries


def good_line(key: str, text: str = "ok") -> dict:
    return {"key": key, "v": CACHE_VERSION, "gen": {"text": text, "prompt_tokens": 3, "visual_tokens": None,
                                                   "output_tokens": 2, "extra": {}, "measured": {}}}


BAD = {
    "no gen": lambda k: {"key": k, "v": CACHE_VERSION},
    "text not a string": lambda k: {**good_line(k), "gen": {**good_line(k)["gen"], "text": 5}},
    "unknown version": lambda k: {**good_line(k), "v": 99},
    "negative count": lambda k: {**good_line(k), "gen": {**good_line(k)["gen"], "output_tokens": -1}},
    "extra not an object": lambda k: {**good_line(k), "gen": {**good_line(k)["gen"], "extra": [1]}},
}


def test_invalid_entries_are_skipped_counted_and_a_later_valid_one_replayed(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    lines = [good_line("good")] + [make(name) for name, make in BAD.items()]
    (d / "a.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    cache = GenerationCache(d)
    assert cache.get("good")["text"] == "ok"
    assert all(cache.get(name) is None for name in BAD)  # a miss: the run regenerates it
    stats = cache.stats()
    assert stats["invalid_lines"] == len(BAD) and stats["invalid_skipped"] == len(BAD) and stats["hits"] == 1
    assert set(stats["invalid_reasons"]) == {entry_problem(make(n)) for n, make in BAD.items()}
    # the regenerated entry is appended; the next reader replays it, not the bad one
    cache.put("no gen", {"text": "regenerated", "prompt_tokens": 1, "visual_tokens": None, "output_tokens": 1,
                         "extra": {}, "measured": {}})
    cache.close()
    again = GenerationCache(d)
    assert again.get("no gen")["text"] == "regenerated" and again.stats()["invalid_skipped"] == 0


def test_an_entry_changed_after_indexing_is_rechecked(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps(good_line("k")) + "\n")
    cache = GenerationCache(d)
    (d / "a.jsonl").write_text(json.dumps({"key": "k", "v": CACHE_VERSION, "gen": None}) + "\n")
    assert cache.get("k") is None and cache.stats()["invalid_skipped"] == 1


def test_a_run_regenerates_exactly_the_invalid_entries(run, tmp_path):
    first = run(tmp_path / "r1")
    assert len(CountingEngine.calls) == 12 and first["cache"]["written"] == 12
    shard = next((tmp_path / "cache").glob("*.jsonl"))
    lines = [json.loads(l) for l in shard.read_text().splitlines()]
    for i, make in enumerate(BAD.values()):  # spoil 5 of the 12 entries, each a different way
        lines[i] = make(lines[i]["key"])
    shard.write_text("".join(json.dumps(l) + "\n" for l in lines))
    CountingEngine.calls = []
    second = run(tmp_path / "r2", "cache.read=always")
    assert len(CountingEngine.calls) == len(BAD)  # regenerated; the 7 good entries replayed
    assert second["cache"]["invalid_skipped"] == len(BAD) and second["cache"]["hits"] == 12 - len(BAD)
    answers = [json.loads(l)["answer"] for l in (tmp_path / "r2/samples.jsonl").read_text().splitlines()]
    assert all(a.startswith("answer ") for a in answers)  # nothing bad was replayed as an answer


def test_a_link_planted_in_the_cache_is_never_read(tmp_path):
    d = tmp_path / "c"
    d.mkdir()
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(json.dumps(good_line("planted")) + "\n")
    (d / "evil.jsonl").symlink_to(outside)
    cache = GenerationCache(d)
    assert cache.get("planted") is None and cache.stats()["skipped_lines"] == 1


# ------------------------------------------------------------------------------------------ storage


def erofs_under(monkeypatch, root: Path, code: int = errno.EROFS):
    """Every file the harness creates under ``root`` fails as on a read-only (or full) file system."""
    import harness.config.paths as paths

    real = paths.open_new

    def open_new(path, *a, **k):
        if str(path).startswith(str(root)):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *a, **k)

    monkeypatch.setattr(paths, "open_new", open_new)


def test_a_read_only_run_directory_stops_before_anything_runs(run, tmp_path, monkeypatch):
    erofs_under(monkeypatch, tmp_path / "ro")
    with pytest.raises(StorageError) as e:
        run(tmp_path / "ro" / "run")
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "ro" / "run") in msg and "read-only file system" in msg
    assert "hydra.run.dir" in msg and CountingEngine.calls == []


def test_a_read_only_or_full_cache_stops_before_anything_runs(run, tmp_path, monkeypatch):
    erofs_under(monkeypatch, tmp_path / "cache", errno.ENOSPC)
    with pytest.raises(StorageError) as e:
        run(tmp_path / "r")
    assert f"cache.path={tmp_path / 'cache'} is not writable (the disk is full)" in str(e.value)
    assert "cache.enabled=false" in str(e.value) and CountingEngine.calls == []


def test_a_finished_run_on_read_only_media_is_read_not_refused(run, tmp_path, monkeypatch):
    done = run(tmp_path / "r")
    erofs_under(monkeypatch, tmp_path)
    CountingEngine.calls = []
    again = run(tmp_path / "r")
    assert again["metrics"] == done["metrics"] and CountingEngine.calls == []


def test_a_full_disk_mid_run_stops_with_one_line_and_the_rerun_resumes(run, tmp_path, monkeypatch):
    import harness.run.cache as cache_mod

    real_open = cache_mod.GenerationCache._open_shard

    class FullAfterOne:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, data):
            self.n += 1
            if self.n > 1:
                self.f.write(data[: len(data) // 2])  # a torn line, as a full disk leaves
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def open_shard(self):
        real_open(self)
        self._f = FullAfterOne(self._f)

    monkeypatch.setattr(cache_mod.GenerationCache, "_open_shard", open_shard)
    with pytest.raises(StorageError) as e:
        run(tmp_path / "r", "engine.batch_size=1")
    msg = str(e.value)
    assert "\n" not in msg and "No space left on device" in msg and "free space" in msg
    assert "the 1 generations already in" in msg
    assert json.loads((tmp_path / "r/run_state.json").read_text())["status"] == "running"
    shard = next((tmp_path / "cache").glob("*.jsonl"))
    assert len(shard.read_text().splitlines()) == 1 and shard.read_text().endswith("\n")  # torn line removed
    monkeypatch.setattr(cache_mod.GenerationCache, "_open_shard", real_open)
    CountingEngine.calls = []
    summary = run(tmp_path / "r", "engine.batch_size=1")  # space freed: the same command resumes
    assert len(CountingEngine.calls) == 11 and summary["cache"]["hits"] == 1


def test_a_link_planted_at_the_run_lock_is_refused(run, tmp_path):
    from harness.run.state import RunDirLocked

    target = tmp_path / "victim"
    target.write_text("precious")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / ".lock").symlink_to(target)
    with pytest.raises(RunDirLocked, match="symbolic link"):
        run(tmp_path / "r")
    assert target.read_text() == "precious"


def test_state_and_lock_files_never_follow_links(tmp_path):
    from harness.config.paths import open_new, write_atomic
    from harness.run.state import write_state

    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "run_state.json").symlink_to(victim)
    write_state(tmp_path, {"status": "running"})  # the link is replaced, its target untouched
    assert victim.read_text() == "precious" and not (tmp_path / "run_state.json").is_symlink()
    (tmp_path / "new").symlink_to(victim)
    with pytest.raises(FileExistsError):
        open_new(tmp_path / "new")
    write_atomic(tmp_path / "x.json", b"{}", 0o600)
    assert (tmp_path / "x.json").stat().st_mode & 0o077 == 0


def test_a_killed_sere_artifact_build_leaves_no_temporary_behind(tmp_path):
    import torch

    from harness.techniques.sere.calibration import save_similarity

    dead = 2 ** 22 + 12345  # above pid_max's default: no such process
    left = tmp_path / f".sim.safetensors.{socket.gethostname()}.{dead}.abc123.tmp"
    left.write_bytes(b"half a file")
    other_host = tmp_path / ".sim.safetensors.another-host.1.abc.tmp"
    other_host.write_bytes(b"not ours to judge")
    save_similarity(tmp_path / "sim.safetensors", {0: torch.eye(4)})
    assert not left.exists() and other_host.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [other_host.name, "sim.safetensors", "sim.safetensors.json"])


def test_an_unwritable_sere_artifact_cache_stops_before_the_model_loads(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from harness.config.schema import Config
    from harness.run.state import check_storage

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "hc"))
    erofs_under(monkeypatch, tmp_path / "hc")
    cfg = OmegaConf.structured(Config)
    cfg.cache.path = str(tmp_path / "cache")
    cfg.sere.k = 2
    with pytest.raises(StorageError) as e:
        check_storage(cfg, tmp_path / "run")
    assert f"SERE's artifact cache {tmp_path / 'hc' / 'sere'} is not writable" in str(e.value)
    assert "sere.similarity=FILE" in str(e.value)
    cfg.sere.similarity = str(tmp_path / "sim.safetensors")  # given: nothing is built there, nothing refused
    assert check_storage(cfg, tmp_path / "run") is None


def test_a_full_disk_at_samples_jsonl_stops_with_one_line_and_keeps_the_cache(run, tmp_path, monkeypatch):
    import harness.results.schema as schema

    real = schema.SamplesLog.write
    written = []

    def write(self, record):
        if len(written) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        written.append(record["uid"])
        return real(self, record)

    monkeypatch.setattr(schema.SamplesLog, "write", write)
    with pytest.raises(StorageError) as e:
        run(tmp_path / "r", "engine.batch_size=1")
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'r' / 'samples.jsonl'}: No space left on device (hydra.run.dir): free space")
    assert msg.endswith("the rerun resumes from the generation cache") and "\n" not in msg
    assert json.loads((tmp_path / "r/run_state.json").read_text())["status"] == "running"
    monkeypatch.setattr(schema.SamplesLog, "write", real)
    CountingEngine.calls = []
    summary = run(tmp_path / "r", "engine.batch_size=1")
    assert summary["cache"]["hits"] == 4 and len(CountingEngine.calls) == 8  # nothing generated was lost


def test_a_run_directory_hydra_cannot_create_is_one_line(tmp_path):
    """Hydra creates hydra.run.dir before the run starts: a path under a file (or a read-only mount) ended in
    Hydra's traceback."""
    import subprocess
    import sys

    (tmp_path / "file").write_text("x")
    proc = subprocess.run([sys.executable, "-m", "harness", "wandb.mode=disabled",
                           f"hydra.run.dir={tmp_path / 'file' / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    (line,) = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert "the run directory cannot be created; set hydra.run.dir" in line and str(tmp_path / "file") in line
