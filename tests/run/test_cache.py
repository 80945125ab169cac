"""harness.run.cache: keys, the shard store, replay without timings; and resume of a SIGKILLed run (cache.read modes).

The run-level tests need the run integration (``cache`` config group + ``run_experiment`` looking requests up);
they are skipped until ``harness.config.schema.Config`` has a ``cache`` field.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from harness.run.cache import (GenerationCache, engine_identity, generation_from_cache, generation_to_dict, key_for,
                           keys_for_requests, model_fingerprint, model_key, technique_settings)
from harness.engines.base import Generation, Request

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures"
GEN = {"max_new_tokens": 64, "do_sample": False}
VZ_OFF = {"keep": 1.0, "contextual": 0.0, "scope": "request", "layer": -1, "min_per_image": 1}
SERE_OFF = {"k": None, "rho": 0.1, "protect": 0, "similarity": None, "protection": None}
TECH = {"visionzip": VZ_OFF, "sere": SERE_OFF}


def image(color=(200, 10, 10), size=(32, 24)):
    return Image.new("RGB", size, color)


def request(uid="a", text="请回答", images=None):
    images = [image()] if images is None else images
    content = [{"type": "image", "index": i} for i in range(len(images))] + [{"type": "text", "text": text}]
    return Request(uid=uid, content=content, images=images)


# ------------------------------------------------------------------------------------------------ keys


def test_key_is_stable_and_ignores_the_uid():
    k = key_for("m", request("a"), GEN, TECH)
    assert k == key_for("m", request("b"), dict(GEN), {"sere": SERE_OFF, "visionzip": VZ_OFF})
    assert len(k) == 64 and int(k, 16) >= 0


def test_key_follows_everything_that_determines_the_output():
    base = key_for("m", request(), GEN, TECH)
    changed = [
        key_for("m2", request(), GEN, TECH),
        key_for("m", request(text="请回答!"), GEN, TECH),
        key_for("m", request(images=[image(color=(200, 10, 11))]), GEN, TECH),  # one pixel value differs
        key_for("m", request(images=[image(size=(24, 32))]), GEN, TECH),
        key_for("m", request(images=[image(), image()]), GEN, TECH),
        key_for("m", request(), {**GEN, "max_new_tokens": 65}, TECH),
        key_for("m", request(), GEN, {**TECH, "visionzip": {**VZ_OFF, "keep": 0.6}}),
        key_for("m", request(), GEN, {**TECH, "sere": {**SERE_OFF, "k": 2}}),
    ]
    assert len({base, *changed}) == len(changed) + 1


def test_an_image_decoded_twice_has_one_key(tmp_path):
    p = tmp_path / "x.png"
    image().save(p)
    a = key_for("m", request(images=[Image.open(p)]), GEN, TECH)
    assert a == key_for("m", request(images=[Image.open(p).convert("RGB")]), GEN, TECH)


def test_technique_settings_normalise_off_techniques(tmp_path):
    off = technique_settings(TECH)
    assert off == {"visionzip": None, "sere": None}
    # keep = 1.0 is off whatever the scope; SERE off whatever rho / protect
    assert technique_settings({"visionzip": {**VZ_OFF, "scope": "image"}, "sere": {**SERE_OFF, "rho": 0.5,
                                                                                     "protect": 16}}) == off
    vz = {**VZ_OFF, "keep": 0.6}
    assert technique_settings({"visionzip": vz})["visionzip"] != technique_settings(
        {"visionzip": {**vz, "scope": "image"}})["visionzip"]
    on = {**SERE_OFF, "k": 2}
    assert technique_settings({"sere": on}) != technique_settings({"sere": {**on, "rho": 0.3}})
    # an artifact's content is part of the key, not only its path
    art = tmp_path / "sim.safetensors"
    art.write_bytes(b"one")
    k1 = key_for("m", request(), GEN, {"sere": {**on, "similarity": str(art)}})
    art.write_bytes(b"two")
    assert k1 != key_for("m", request(), GEN, {"sere": {**on, "similarity": str(art)}})
    # DictConfig blocks work as plain dicts do
    from omegaconf import OmegaConf

    assert technique_settings({"visionzip": OmegaConf.create(vz)}) == technique_settings({"visionzip": vz})


def test_keys_for_requests_matches_key_for():
    reqs = [request("a"), request("b", text="x")]
    assert keys_for_requests("m", reqs, GEN, TECH) == [key_for("m", r, GEN, TECH) for r in reqs]


def test_model_fingerprint(tmp_path):
    assert model_fingerprint({"fingerprint": "f36d53f9cbf3"}) == "fp:f36d53f9cbf3"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text('{"a": 1}')
    (ckpt / "model.safetensors").write_bytes(b"0" * 10)
    a = model_fingerprint({}, str(ckpt))
    (ckpt / "config.json").write_text('{"a": 2}')
    b = model_fingerprint({}, str(ckpt))
    (ckpt / "model.safetensors").write_bytes(b"0" * 11)
    assert len({a, b, model_fingerprint({}, str(ckpt))}) == 3 and a.startswith("dir:")
    assert model_fingerprint({}, "Org/Some-Model").startswith("hub:Org/Some-Model@")
    e0 = {"engine": "hf", "engine_version": "5", "device": "cuda:0", "device_name": "H200", "dtype": "bfloat16",
          "batch_size": 8}
    assert engine_identity(e0) == engine_identity({**e0, "device": "cuda:3", "device_name": "H100"})
    assert model_key({"fingerprint": "x"}, None, e0) != model_key({"fingerprint": "x"}, None, {**e0, "batch_size": 4})


# ------------------------------------------------------------------------------------------------ store


def gen(uid="a", text="answer", **kw):
    return Generation(uid=uid, text=text, prompt_tokens=120, visual_tokens=64, output_tokens=7, ttft_ms=12.5,
                      tpot_ms=3.0, e2e_ms=30.5, extra={"visionzip": {"kept_per_image": [3], "importance_ms": 0.7}},
                      **kw)


def test_put_get_across_instances(tmp_path):
    with GenerationCache(tmp_path / "c") as c:
        assert c.get("k1") is None
        c.put("k1", gen())
        assert c.get("k1")["text"] == "answer"  # visible at once to the writer
    c2 = GenerationCache(tmp_path / "c")
    entry = c2.get("k1")
    assert entry["text"] == "answer" and entry["output_tokens"] == 7
    assert entry["measured"] == {"ttft_ms": 12.5, "tpot_ms": 3.0, "e2e_ms": 30.5}
    assert c2.stats() | {"path": None} == {"path": None, "read": True, "entries": 1, "hits": 1, "misses": 0,
                                           "written": 0, "skipped_lines": 0, "invalid_lines": 0,
                                           "invalid_skipped": 0, "invalid_reasons": {}}


def test_failed_generations_are_not_cached(tmp_path):
    c = GenerationCache(tmp_path)
    c.put("k", gen(error="CUDA out of memory"))
    c.close()
    assert len(GenerationCache(tmp_path)) == 0


def test_replay_has_no_timings():
    g = generation_from_cache(generation_to_dict(gen()), uid="other")
    assert (g.uid, g.text, g.prompt_tokens, g.visual_tokens, g.output_tokens) == ("other", "answer", 120, 64, 7)
    assert g.ttft_ms is g.tpot_ms is g.e2e_ms is None and g.error is None
    assert g.extra == {"visionzip": {"kept_per_image": [3], "importance_ms": None}, "cached": True}


def test_torn_and_corrupt_lines_are_skipped(tmp_path):
    c = GenerationCache(tmp_path)
    c.put("k1", gen())
    c.put("k2", gen(text="second"))
    c.close()
    (shard,) = tmp_path.glob("*.jsonl")
    with open(shard, "ab") as f:
        f.write(b'{"key": "k3", "gen": {"te')  # a writer killed mid-line
    other = tmp_path / "other.jsonl"
    other.write_bytes(b"not json\n" + shard.read_bytes().splitlines(keepends=True)[1])
    c2 = GenerationCache(tmp_path)
    assert len(c2) == 2 and c2.get("k2")["text"] == "second" and c2.get("k3") is None
    assert c2.skipped_lines == 2
    c2.put("k3", gen(text="third"))  # new entries go to a new shard, never after a torn line
    c2.close()
    assert GenerationCache(tmp_path).get("k3")["text"] == "third"


def test_concurrent_writers_share_one_directory(tmp_path):
    a, b = GenerationCache(tmp_path), GenerationCache(tmp_path)
    a.put("ka", gen(text="A"))
    b.put("kb", gen(text="B"))
    a.close(), b.close()
    assert len(list(tmp_path.glob("*.jsonl"))) == 2
    c = GenerationCache(tmp_path)
    assert (c.get("ka")["text"], c.get("kb")["text"]) == ("A", "B")


def test_write_only_mode_and_bad_paths(tmp_path):
    c = GenerationCache(tmp_path)
    c.put("k", gen())
    c.close()
    w = GenerationCache(tmp_path, read=False)
    assert w.get("k") is None and w.misses == 1
    with pytest.raises(ValueError, match="directory"):
        GenerationCache(tmp_path / "generations.sqlite")


# ------------------------------------------------------------------------------------------------ resume

def _has_cache_config() -> bool:
    from harness.config.schema import Config

    return "cache" in {f.name for f in dataclasses.fields(Config)}


needs_integration = pytest.mark.skipif(not _has_cache_config(), reason="run integration of the generation cache "
                                       "(Config.cache, run_experiment lookup) not applied yet")

BOOT = ("import sys; sys.path.insert(0, {fixtures!r}); from harness.engines import ENGINES; "
        "ENGINES['counting'] = 'counting_engine:CountingEngine'; from harness.cli import main; main()")
COMMON = ("engine.name=counting", "engine.batch_size=1", "engine.warmup=0", "model.embedded=false",
          "model.path=unused", "wandb.mode=disabled")


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a harness subprocess (this checkout's package first: tests/conftest.py), W&B quiet."""
    return {**os.environ, "WANDB_SILENT": "true", **extra}


def start(tmp_path, run_dir, *overrides, delay=0.0):
    env = subprocess_env(COUNTING_ENGINE_LOG=str(tmp_path / "calls.log"), COUNTING_ENGINE_DELAY=str(delay))
    cmd = [sys.executable, "-c", BOOT.format(fixtures=str(FIXTURES)), *COMMON, f"cache.path={tmp_path / 'cache'}",
           f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]


def calls(tmp_path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().split() if log.exists() else []


def lines(path: Path) -> list[dict]:
    return [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines()]


def kill_after(proc, samples: Path, n: int) -> None:
    deadline = time.time() + 120
    while time.time() < deadline and (not samples.exists() or len(samples.read_text().splitlines()) < n):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


@needs_integration
@pytest.mark.slow
def test_a_killed_run_resumes_calling_the_model_only_for_unfinished_samples(tmp_path):
    # reference: the same run without the cache, uninterrupted
    finish(start(tmp_path, tmp_path / "ref", "cache.enabled=false"))
    ref = json.loads((tmp_path / "ref/summary.json").read_text())
    assert len(calls(tmp_path)) == 12 and not (tmp_path / "cache").exists()
    (tmp_path / "calls.log").unlink()

    # attempt 1, killed with SIGKILL after a few samples
    run = tmp_path / "run"
    kill_after(start(tmp_path, run, delay=0.4), run / "samples.jsonl", 4)
    assert not (run / "summary.json").exists()
    finished1 = {r["uid"] for r in lines(run / "samples.jsonl")}
    calls1 = calls(tmp_path)
    n_cached = len(GenerationCache(tmp_path / "cache"))
    assert 4 <= len(finished1) <= n_cached < 12 and len(calls1) >= n_cached

    # attempt 2: the same command (same run directory) resumes; the model sees only what was not finished
    finish(start(tmp_path, run))
    calls2 = calls(tmp_path)[len(calls1):]
    assert len(calls2) == len(set(calls2)) == 12 - n_cached
    assert set(calls2).isdisjoint(finished1)
    s2 = json.loads((run / "summary.json").read_text())
    assert s2["metrics"] == ref["metrics"]
    by_uid = {r["uid"]: r for r in lines(run / "samples.jsonl")}
    ref_by_uid = {r["uid"]: r for r in lines(tmp_path / "ref/samples.jsonl")}
    assert by_uid.keys() == ref_by_uid.keys()  # 12 lines: the killed attempt's file was set aside, not appended to
    assert len(lines(run / "samples.jsonl.interrupted-1")) == len(finished1)
    assert all(by_uid[u]["answer"] == ref_by_uid[u]["answer"] and by_uid[u]["scores"] == ref_by_uid[u]["scores"]
               for u in by_uid)
    # latency is never replayed: only the requests generated in attempt 2 are timed, and the summary says so
    replayed = [r for r in by_uid.values() if r["cached"]]
    assert len(replayed) == n_cached and all(r["ttft_ms"] is None and r["tpot_ms"] is None for r in replayed)
    lat = s2["latency"]
    assert lat["partial"] is True and lat["n_cached"] == n_cached and lat["n_measured"] == 12 - n_cached
    assert lat["ttft_ms"]["n"] == 12 - n_cached
    assert s2["cache"]["hits"] == n_cached and s2["cache"]["written"] == 12 - n_cached
    assert ref["latency"]["partial"] is False and ref["latency"]["n_measured"] == 12

    # attempt 3: the directory finished with this configuration, so nothing runs (a resumed sweep's done jobs)
    before = (run / "summary.json").read_bytes()
    finish(start(tmp_path, run))
    assert len(calls(tmp_path)) == len(calls1) + len(calls2)
    assert (run / "summary.json").read_bytes() == before

    # a fresh run directory is measured in full (the default cache.read=resume does not replay into it) ...
    finish(start(tmp_path, tmp_path / "fresh"))
    fresh = json.loads((tmp_path / "fresh/summary.json").read_text())
    assert len(calls(tmp_path)) == len(calls1) + len(calls2) + 12 and fresh["latency"]["partial"] is False
    # ... unless replay is asked for: cache.read=always
    finish(start(tmp_path, tmp_path / "replayed", "cache.read=always"))
    replay = json.loads((tmp_path / "replayed/summary.json").read_text())
    assert len(calls(tmp_path)) == len(calls1) + len(calls2) + 12
    assert replay["metrics"] == ref["metrics"] and replay["latency"]["n_measured"] == 0
    assert replay["latency"]["ttft_ms"]["n"] == 0 and replay["latency"]["partial"] is True


@needs_integration
@pytest.mark.slow
def test_hf_engine_generations_replay_identically(tmp_path):
    """The embedded model through the HF engine: a second run (cache.read=always) is served from the cache with
    the same answers and scores, and no latency."""
    env = subprocess_env()
    args = [sys.executable, "-m", "harness", "dataset=ocr_cc_mix_sample", "dataset.limit=4", "engine.batch_size=2",
            "engine.warmup=0", "generation.max_new_tokens=4", "wandb.mode=disabled", f"cache.path={tmp_path / 'c'}"]
    for name, read in (("a", "resume"), ("b", "always")):
        proc = subprocess.run([*args, f"hydra.run.dir={tmp_path / name}", f"cache.read={read}"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = (json.loads((tmp_path / n / "summary.json").read_text()) for n in ("a", "b"))
    assert a["metrics"] == b["metrics"]
    assert a["latency"]["partial"] is False and a["cache"]["written"] == a["latency"]["n_measured"] > 0
    assert b["latency"]["partial"] is True and b["latency"]["n_measured"] == 0 and b["latency"]["ttft_ms"]["n"] == 0
    sa, sb = (sorted(lines(tmp_path / n / "samples.jsonl"), key=lambda r: r["uid"]) for n in ("a", "b"))
    assert [(r["uid"], r["answer"], r["output_tokens"], r["prompt_tokens"]) for r in sa] == \
        [(r["uid"], r["answer"], r["output_tokens"], r["prompt_tokens"]) for r in sb]
