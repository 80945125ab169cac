"""``generate_splitting``: the engines' rule for a failing batch — each request is retried alone, so one bad request
costs only itself and every other request still gets its generation."""

from __future__ import annotations

from harness.engines.base import Generation, Request, generate_splitting


def test_a_failing_batch_is_retried_request_by_request():
    calls, failures = [], []

    def run(batch):
        calls.append([r.uid for r in batch])
        if any(r.uid == "bad" for r in batch):
            raise RuntimeError("boom")
        return [Generation(uid=r.uid, text=r.uid) for r in batch]

    batch = [Request(u, [{"type": "text", "text": u}]) for u in ("a", "bad", "c")]
    out = generate_splitting(batch, run, lambda: failures.append(1))
    assert [g.uid for g in out] == ["a", "bad", "c"]
    assert [g.text for g in out if g.error is None] == ["a", "c"]
    assert out[1].error == "RuntimeError: boom" and out[1].text != "bad"
    assert calls == [["a", "bad", "c"], ["a"], ["bad"], ["c"]] and len(failures) == 2


def test_a_clean_batch_runs_once():
    batch = [Request("a", [{"type": "text", "text": "a"}])]
    assert generate_splitting(batch, lambda b: [Generation(uid="a", text="x")])[0].text == "x"
