"""benchmarks/bench_vllm_serve.py's own logic that needs no server: the output-diversity figure its table prints
beside the expert union (a random-weight model decoded greedily can collapse every request onto one token cycle,
and the serving figure then says nothing about SERE), and the report's column from it."""

from __future__ import annotations

import os
import sys

import pytest

from harness.engines.base import Generation

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

import bench_vllm_serve as b  # noqa: E402


def _gen(ids, error=None):
    return Generation(uid="u", extra={"token_ids": list(ids)}, error=error)


def test_collapsed_outputs_show_as_few_distinct_tokens():
    collapsed = [_gen([5, 6, 5, 6]), _gen([5, 6, 5, 6]), _gen([6, 5, 6, 5])]
    got = b.output_diversity(collapsed)
    assert got == {"requests": 3, "distinct_sequences": 2, "distinct_output_tokens": 2,
                   "distinct_tokens_per_position": 2.0}
    spread = b.output_diversity([_gen(range(i * 4, i * 4 + 4)) for i in range(3)])
    assert spread["distinct_output_tokens"] == 12 and spread["distinct_tokens_per_position"] == 3.0


def test_failed_requests_are_not_counted_and_nothing_gives_an_empty_figure():
    assert b.output_diversity([_gen([1, 2]), _gen([], error="timeout")])["requests"] == 1
    assert b.output_diversity([_gen([], error="timeout")]) == {}


def test_report_prints_the_union_with_its_rows_and_the_diversity_beside_it():
    block = {"variant": "off", "qps": 4.0, "pair": ["off", "sere2"], "requests_per_pass": 2, "passes": 1,
             "failed": 0, "runs": [{"routing": {"expert_union_before": 16.0, "expert_union_after": 4.0,
                                                "tokens_per_step": 51.2},
                                    "outputs": {"distinct_output_tokens": 3, "distinct_tokens_per_position": 1.5}}]}
    for m in ("ttft_ms", "tpot_ms", "itl_ms"):
        block[m] = {"p50": 1.0, "p99": 2.0, "mean": 1.0, "ci": [0.9, 1.1], "pass_p50": [1.0], "pass_p99": [2.0]}
    data = {"argv": "", "env": {}, "dtype": "float32", "weights": "random-init", "eager": True,
            "decoding": "greedy", "text": {"off@4": [block]}}
    md = b.report(data)
    assert "decoding **greedy**" in md and "| 16.0 → 4.0 (51 rows) | 3 (1.5) |" in md


def test_vl_passes_never_resend_a_request_so_no_server_hits_a_cache():
    """The warm-up and each pass get their own requests (session 15: the same 10 requests in every pass let the
    keep 1.0 server reuse its processor and encoder caches, which the VisionZip servers cannot)."""
    pool = list(range(4 + 3 * 2))
    at = b.fresh_requests(pool, n=3, warm=4)
    sent = [at(-1), at(0), at(1)]
    assert sent == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    flat = [r for part in sent for r in part]
    assert len(flat) == len(set(flat)) == len(pool)
    import pytest

    with pytest.raises(ValueError):
        at(2)  # a pass the pool has no new requests for is refused, not filled with repeats


def test_vl_requests_have_distinct_images():
    for content in ("noise", "photo"):
        reqs = b.vl_requests(3, images=2, px=8, content=content)
        blobs = [im.tobytes() for r in reqs for im in r.images]
        assert len(set(blobs)) == len(blobs) and all(im.size == (8, 8) for r in reqs for im in r.images)


def test_photo_images_are_smooth_where_noise_is_not():
    """``photo`` is for the serving benchmark's JPEG runs: neighbouring pixels close, as in photographs (which is
    what lets a codec compress them); ``noise`` has no such structure. Mean absolute step between neighbours."""
    import numpy as np
    import pytest

    rng = np.random.default_rng(0)

    def roughness(im):
        a = np.asarray(im, dtype=np.float32)
        return float(np.abs(np.diff(a, axis=1)).mean())

    assert roughness(b.synthetic_image(rng, 64, "photo")) < 10 < roughness(b.synthetic_image(rng, 64, "noise"))
    with pytest.raises(ValueError, match="noise or photo"):
        b.synthetic_image(rng, 8, "cartoon")


def test_server_phases_pool_over_passes_by_requests_and_print_where_ttft_goes():
    """Each pass's /metrics means are weighted by the requests they cover; a pass whose phases could not be read
    (an ``error`` instead of figures) is left out of the pool rather than counted as zero."""
    runs = [{"server_phases": {"requests": 1, "client_ttft_ms": 100.0, "front_end_ms": 60.0, "queue_ms": 10.0,
                               "prefill_ms": 30.0, "decode_ms": 5.0}},
            {"server_phases": {"requests": 3, "client_ttft_ms": 200.0, "front_end_ms": 120.0, "queue_ms": 20.0,
                               "prefill_ms": 60.0, "decode_ms": 9.0}},
            {"server_phases": {"error": "URLError: refused"}}]
    block = {"variant": "keep0.5", "qps": 0.5, "runs": runs}
    got = b.pooled_phases(block)
    assert got["requests"] == 4 and got["client_ttft_ms"] == 175.0 and got["prefill_ms"] == 52.5
    assert b.pooled_phases({"runs": [runs[2]]}) is None
    md = "\n".join(b.phase_table({"vl": {"keep0.5@0.5": [block]}}))
    assert "| vl | 0.5 | keep 0.5 | 4 | 175.0 | 105.0 | 17.5 | 52.5 | 8.0 |" in md
    assert b.phase_table({"text": {}}) == []


def test_30b_servers_pair_on_an_h200_and_take_turns_on_an_h100():
    from harness.models.real_shapes import shapes_config

    config = shapes_config("qwen3_30b_a3b")
    assert b.residency(config, "auto", None, 150_000_000_000) == (2, b.MEM_PAIR)   # H200: 0.46 x 150 GB = 69 GB
    assert b.residency(config, "auto", None, 85_000_000_000) == (1, b.MEM_ONE)     # H100: one at 0.90 = 76 GB
    with pytest.raises(ValueError, match="61.1 GB of weights.*one server at a time"):
        b.residency(config, "2", None, 85_000_000_000)                             # asked for two: refused
    with pytest.raises(ValueError, match="1 server"):
        b.residency(config, "auto", None, 40_000_000_000)                          # not even one
    assert b.residency(config, "auto", None, None) == (2, b.MEM_PAIR)              # no GPU (CPU smoke): as asked
    assert b.residency(config, "1", 0.8, None) == (1, 0.8)


def test_the_schedule_is_abba_per_point_with_two_servers_and_per_visit_with_one():
    points = [(64.0, 2), (16.0, 3)]
    two = b.schedule(["off", "sere2"], points, 2, resident=2)
    assert two[:4] == [("off", 0, 64.0, 2), ("sere2", 0, 64.0, 2), ("sere2", 1, 64.0, 2), ("off", 1, 64.0, 2)]
    one = b.schedule(["off", "sere2"], points, 2, resident=1)
    assert [(v, p) for v, p, _, _ in one] == [("off", 0)] * 2 + [("sere2", 0)] * 2 + [("sere2", 1)] * 2 + \
        [("off", 1)] * 2
    assert sorted(two) == sorted(one)   # the same measurements, another order


class _Server:
    log_path = None

    def describe(self):
        return {}


class _Engine:
    def __init__(self, name, log):
        self.name, self.log, self._server, self.closed = name, log, _Server(), False

    def describe(self):
        return {"engine": "fake"}

    def close(self):
        self.closed = True
        self.log.append(("close", self.name))


@pytest.mark.parametrize("resident,starts", [(2, {"off": 1, "sere2": 1}), (1, {"off": 2, "sere2": 1})])
def test_pairs_run_with_the_servers_the_card_holds_and_write_each_point_when_done(monkeypatch, tmp_path, resident,
                                                                                   starts):
    log, up = [], set()

    def make(name):
        assert len(up) < resident, f"{name} started while {up} still held the GPU"
        log.append(("start", name))
        up.add(name)
        eng = _Engine(name, log)
        orig = eng.close
        eng.close = lambda: (up.discard(name), orig())
        return eng, 1.0

    def run_point(eng, requests, qps, n, seed, timeout_s, bursts=False):
        assert not eng.closed
        assert bursts == (seed == 99)                                       # only the warm-up bursts
        log.append(("run", eng.name, seed, qps))
        return [], {}

    monkeypatch.setattr(b, "run_point", run_point)
    monkeypatch.setattr(b, "server_stats", lambda eng, reset: None)
    monkeypatch.setattr(b, "summarise", lambda samples: {"ttft_ms": {"p50": 1.0, "p99": 2.0}, "failed": 0,
                                                         "tpot_ms": {"p50": 1.0, "p99": 2.0}})
    res = b.Results(tmp_path / "r.json", {})
    b.measure_pairs("text", [["off", "sere2"]], make, lambda p: [], [(64.0, 2), (16.0, 2)], 2, res, (1.0, 1), None,
                    resident)
    runs = [e[1:] for e in log if e[0] == "run" and e[2] != 99]             # 99: the warm-up's seed
    assert sorted(runs) == sorted((v, p, q) for v in ("off", "sere2") for p in (0, 1) for q in (64.0, 16.0))
    assert {name: len(e["starts_s"]) for name, e in res.data["servers"]["text"].items()} == starts
    assert set(res.data["text"]) == {"off@64", "sere2@64", "off@16", "sere2@16"}
    assert all(block["resident"] == resident and block["passes"] == 2 for blocks in res.data["text"].values()
               for block in blocks)
    assert not up                                                          # every server stopped at the end


def test_a_server_that_does_not_start_is_a_note_and_the_next_pair_runs(monkeypatch, tmp_path):
    def make(name):
        if name == "sere1":
            raise RuntimeError("vllm serve exited with status 1")
        return _Engine(name, []), 1.0

    monkeypatch.setattr(b, "run_point", lambda *a, **k: ([], {}))
    monkeypatch.setattr(b, "server_stats", lambda eng, reset: None)
    monkeypatch.setattr(b, "summarise", lambda samples: {"ttft_ms": {"p50": 1.0, "p99": 2.0}, "failed": 0,
                                                         "tpot_ms": {"p50": 1.0, "p99": 2.0}})
    res = b.Results(tmp_path / "r.json", {})
    b.measure_pairs("text", [["off", "sere1"], ["off", "top2"]], make, lambda p: [], [(4.0, 1)], 2, res,
                    (1.0, 1), None, 1)
    assert any("sere1 did not start" in note for note in res.data["notes"])
    assert set(res.data["text"]) == {"off@4", "top2@4"}


def test_each_start_records_and_prints_where_its_start_up_went(monkeypatch, tmp_path, capsys):
    """A server's start-up phases (vLLM's own log lines, ``harness.engines.vllm.server_startup``) go into the
    results beside its wall time and into the progress line, per start."""
    class Timed(_Server):
        def describe(self):
            return {"startup_s": 181.0, "startup_phases": {"torch_compile_s": 41.2, "cuda_graphs_s": 38.0,
                                                           "engine_init_s": 89.6}}

    def make(name):
        eng = _Engine(name, [])
        eng._server = Timed()
        return eng, 181.0

    monkeypatch.setattr(b, "run_point", lambda *a, **k: ([], {}))
    monkeypatch.setattr(b, "server_stats", lambda eng, reset: None)
    monkeypatch.setattr(b, "summarise", lambda samples: {"ttft_ms": {"p50": 1.0, "p99": 2.0}, "failed": 0,
                                                         "tpot_ms": {"p50": 1.0, "p99": 2.0}})
    res = b.Results(tmp_path / "r.json", {})
    b.measure_pairs("text", [["off", "sere2"]], make, lambda p: [], [(4.0, 1)], 1, res, (1.0, 1), None, 1)
    off = res.data["servers"]["text"]["off"]
    assert off["starts_s"] == [181.0] and off["server"]["startup_phases"]["engine_init_s"] == 89.6
    assert "off: server up in 181 s (vLLM: torch compile 41 s, cuda graphs 38 s, engine init 90 s)" in \
        capsys.readouterr().out
