"""``scoring.stopwords``: the Rouge-1 stopword list is a choice — the project's list, none, or a file (e.g. the
reference's ``cn_stopwords.txt``) — and the scorer uses and records it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from harness.metrics import rag_igbench as rb
from harness.metrics import rag_igbench_words as rw


def test_resolve_choices(tmp_path):
    assert rw.resolve_stopwords("public") == rw.resolve_stopwords(None) == rw.load_stopwords()  # the default
    assert rw.resolve_stopwords("project") == rw.load_stopwords(rw.PROJECT_STOPWORDS) != rw.load_stopwords()
    assert len(rw.resolve_stopwords("project")) > 100
    assert rw.resolve_stopwords("none") == frozenset()
    path = tmp_path / "stop.txt"
    path.write_text("北京\n爱\n", encoding="utf-8")
    assert rw.resolve_stopwords(str(path)) == {"北京", "爱"}
    with pytest.raises(FileNotFoundError, match="scoring.stopwords"):
        rw.resolve_stopwords(str(tmp_path / "missing.txt"))


def test_choice_changes_rouge1(tmp_path):
    pred, ref = "我的北京很美", "你的北京很大"
    project = rb.rouge1(pred, ref, stopwords=rw.resolve_stopwords("project"))
    none = rb.rouge1(pred, ref, stopwords=rw.resolve_stopwords("none"))
    path = tmp_path / "stop.txt"
    path.write_text("北京\n", encoding="utf-8")
    own = rb.rouge1(pred, ref, stopwords=rw.resolve_stopwords(str(path)))
    words_none = rw.words(pred, frozenset())
    assert "的" in words_none and "的" not in rw.words(pred, rw.resolve_stopwords("project"))
    assert len({project, none, own}) == 3


def _answer(text):
    return json.dumps({"reason": "r", "category": "c", "answer": text}, ensure_ascii=False)


def test_scorer_passes_and_records_the_choice(tmp_path):
    from harness.datasets.base import Sample
    from harness.metrics.scoring import Scorer

    sample = Sample(uid="s", dataset="rag", task="rag_igbench", content=[], images=[],
                    reference={"answer": "你的北京很大", "n_candidates": 0})
    base = dict(rouge_variant="reference", clip_model=None, clip_pretrained=None, embed_model=None)
    got = {}
    for choice in ("public", "project", "none"):
        scorer = Scorer(SimpleNamespace(**base, stopwords=choice))
        got[choice] = scorer(sample, _answer("我的北京很美"))["rouge1"]
        assert scorer.describe()["stopwords"] == choice
    assert got["project"] == rb.rouge1("我的北京很美", "你的北京很大", stopwords=rw.resolve_stopwords("project"))
    assert got["none"] == rb.rouge1("我的北京很美", "你的北京很大", stopwords=frozenset()) != got["project"]
    assert got["public"] == rb.rouge1("我的北京很美", "你的北京很大", stopwords=rw.resolve_stopwords("public"))
    assert Scorer(SimpleNamespace(**base)).stopwords_choice == "public"  # unset / null: the public list
    with pytest.raises(FileNotFoundError):
        Scorer(SimpleNamespace(**base, stopwords=str(tmp_path / "nope.txt")))


def test_run_records_scoring_choices(tmp_path):
    """End to end: ``scoring.stopwords=none`` reaches summary.json ``run.scoring`` (and the config)."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "harness", "wandb.mode=disabled", "dataset.limit=2", "generation.max_new_tokens=4",
           "scoring.clip_model=null", "scoring.embed_model=null", "scoring.stopwords=none",
           f"cache.path={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["run"]["scoring"]["stopwords"] == "none" and summary["run"]["scoring"]["stopword_count"] == 0
    assert summary["run"]["scoring"]["mcq_extraction"] == "vlmevalkit"
