"""One registry (harness/registry.py) for engines, dataset loaders and task scorers; a dataset added from
outside the package through the registry alone: one loader module + one YAML (issue 24, item 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.datasets import LOADERS
from harness.engines import ENGINES
from harness.metrics.scoring import TASKS
from harness.techniques.offload.policy import POLICIES
from harness.registry import Registry, UnknownName

ROOT = Path(__file__).resolve().parents[1]


def test_entries_are_lazy_until_loaded_and_then_cached():
    reg = Registry("thing", "thing.name", {"path": "os.path:join"})
    assert reg["path"] == "os.path:join"  # as registered: nothing imported yet
    assert reg.load("path") is os.path.join
    assert reg.load("path") is reg.load("path")


def test_decorator_and_call_register_and_unknown_names_suggest():
    reg = Registry("scorer", "scoring.name")

    @reg.register("exact")
    def exact(a, b):
        return a == b

    reg.register("fuzzy", "difflib:SequenceMatcher")
    assert sorted(reg) == ["exact", "fuzzy"] and "exact" in reg and len(reg) == 2
    assert reg.load("exact") is exact
    with pytest.raises(UnknownName) as e:
        reg.load("exakt")
    assert str(e.value) == "unknown scorer 'exakt' (scoring.name). Did you mean exact? Known: exact, fuzzy"
    with pytest.raises(ValueError, match="package.module:attribute"):
        Registry("x", "x", {"bad": "no_colon"}).load("bad")


def test_the_package_registries_are_registries():
    for reg in (ENGINES, LOADERS, TASKS, POLICIES):
        assert isinstance(reg, Registry)
    assert {"hf", "vllm"} <= set(ENGINES)
    assert {"rag_igbench", "ocrbench", "ccbench", "ocr_cc_mix", "synthetic_load"} <= set(LOADERS)
    assert {"rag_igbench", "ocrbench", "mcq", "no_reference"} <= set(TASKS)
    assert {"none", "lru", "oracle", "lfu", "static_hot", "lease"} <= set(POLICIES)
    assert POLICIES.load("lru").name == "lru"  # the decorator in its module set the name when it was imported


TOY_LOADER = '''
from harness.datasets.base import Sample
from harness.metrics.scoring import TASKS, TaskScoring


def _score(scorer, sample, answer, error):
    return {"correct": error is None and sample.reference["answer"] in (answer or ""), "error": error}


def _aggregate(scores):
    return {"toy_accuracy": sum(s["correct"] for s in scores) / len(scores), "toy_scored": len(scores)}


TASKS.register("toy_contains", TaskScoring(_score, _aggregate))  # a new kind of answer: its own metric


def load(cfg, root):
    for i, (question, answer) in enumerate([("Answer in JSON.", "{"), ("Say zzzzqqq.", "zzzzqqq")]):
        yield Sample(uid=f"toy-{i}", dataset=cfg.name, task="toy_contains",
                     content=[{"type": "text", "text": question}], reference={"answer": answer})
'''


@pytest.mark.slow
def test_a_dataset_from_outside_the_package_is_one_loader_module_and_one_yaml(tmp_path):
    (tmp_path / "toy_dataset.py").write_text(TOY_LOADER)
    (tmp_path / "conf" / "dataset").mkdir(parents=True)
    (tmp_path / "conf" / "dataset" / "toy.yaml").write_text(textwrap.dedent("""\
        defaults:
          - dataset_schema
        name: toy
        loader: toy_dataset:load
        """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), str(ROOT),
                                                                      os.environ.get("PYTHONPATH")]))}
    base = [sys.executable, "-m", "harness", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "dataset=toy",
            "wandb.mode=disabled", "generation.max_new_tokens=8", "latency.sequential=false"]
    run = subprocess.run(base + [f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    metrics = summary["metrics"]
    assert metrics["n_samples"] == 2 and metrics["toy_scored"] == 2  # both samples scored by the toy task
    assert 0.0 <= metrics["toy_accuracy"] <= 1.0
    assert summary["config"]["dataset"]["loader"] == "toy_dataset:load"

    bad = subprocess.run(base + ["dataset.loader=no_such_module:load", f"hydra.run.dir={tmp_path / 'bad'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: dataset.loader='no_such_module:load' is not allowed")
