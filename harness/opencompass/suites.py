"""Which datasets an OpenCompass run evaluates: named suites, the CI sample, and the offline-data check.

Why named suites: a sweep over SERE settings is only comparable when every job averages the same datasets,
so the set is chosen once, by name (``opencompass.suite``), and recorded in ``summary.json``.

- ``sere_paper`` (the default for a cluster user): the eight datasets the public SERE evaluation reports —
  CMMLU and BoolQ (knowledge / reading), BBH (reasoning), GSM8K, MATH and MATH401 (maths), HumanEval and
  MBPP (code) — through OpenCompass's own ``*_gen`` configs. Generation configs only: SERE and
  ``moe.top_k`` change decode steps, which a perplexity (``ppl``) config never takes. MMLU, which the notes
  also name, is left out: the seed's average is over the paper's list, and MMLU is the slowest of all.
- ``ci_sample``: two datasets in OpenCompass's custom-dataset format, written by :func:`write_ci_sample` from the
  *held-out* split of the text tasks the embedded model is trained on (recipe v7,
  :mod:`harness.datasets.synthetic.text_tasks`): ``harness_text_qa`` (two-digit addition, list operations,
  key-value lookup, interleaved; exact match) and ``harness_text_choice`` (multiple choice over a short passage,
  options A-D), plus ``harness_text_recall`` (closed-book recall of the trained fact table,
  ``text_tasks.recall_facts``; exact match): the seed's knowledge column. A fact cannot be held out — one never
  trained cannot be recalled — so that file asks distinct facts of the whole table, as a knowledge benchmark asks
  what pre-training saw; it is where truncating experts costs (docs/embedded_model_v7.md §12-13). Few files, not
  one per task: OpenCompass starts an evaluation process per dataset, and CI runs the suite three times on two
  cores. A pure function of the seed; no item of the other files was trained on.

Real datasets are read offline from OpenCompass's data cache (``COMPASS_DATA_CACHE``): :func:`check_staged`
refuses, before any model loads, a dataset whose files are not there, naming it and where to stage it
(OpenCompass would otherwise try to download it and fail without network).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# suite name -> [(OpenCompass dataset config module under opencompass.configs.datasets, variable name)]
# The suite's average is over these entries: a dataset with subsets counts once, as its summary group
# (OpenCompass's naive average of its subsets, SUMMARY_GROUPS), not once per subset.
SUITES: dict[str, list[tuple[str, str]]] = {
    "sere_paper": [
        ("cmmlu.cmmlu_gen", "cmmlu_datasets"),
        ("SuperGLUE_BoolQ.SuperGLUE_BoolQ_gen", "BoolQ_datasets"),
        ("bbh.bbh_gen", "bbh_datasets"),
        ("gsm8k.gsm8k_gen", "gsm8k_datasets"),
        ("math.math_gen", "math_datasets"),
        ("math401.math401_gen", "math401_datasets"),
        ("humaneval.humaneval_gen", "humaneval_datasets"),
        ("mbpp.mbpp_gen", "mbpp_datasets"),
    ],
    "ci_sample": [],  # custom-format files written by write_ci_sample
}

# suite -> (summary group module under opencompass.configs.summarizers.groups, variable, group name)
SUMMARY_GROUPS: dict[str, list[tuple[str, str, str]]] = {
    "sere_paper": [("cmmlu", "cmmlu_summary_groups", "cmmlu"), ("bbh", "bbh_summary_groups", "bbh")],
    "ci_sample": [],
}

# file -> the text tasks whose held-out rows it holds (interleaved, ``n`` of each; a closed-book task's file holds
# closed_book_count(n) distinct facts). The multiple-choice file stays last (tests read it as [-1])
CI_SAMPLE_TASKS = {"harness_text_qa.jsonl": ("text_arith", "text_list", "text_lookup"),
                   "harness_text_recall.jsonl": ("text_recall",),
                   "harness_text_choice.jsonl": ("text_choice",)}
#: facts asked per ``n``: one fact is right or wrong as a whole and plain top-1 keeps about half of them, so the
#: ``n`` = 4 of CI's other files could not tell a collapse from chance; 24 facts can (docs/embedded_model_v7.md §13)
CLOSED_BOOK_SCALE = 6
CI_SAMPLE_FILES = tuple(CI_SAMPLE_TASKS)


class OpenCompassDataMissing(FileNotFoundError):
    """A dataset of the suite is not staged in ``COMPASS_DATA_CACHE`` (no network to fetch it)."""


def write_ci_sample(out_dir: str | Path, n: int = 8, seed: int = 0) -> list[Path]:
    """Write the CI suite's custom datasets into ``out_dir`` (``n`` held-out rows of each text task, interleaved
    where a file holds several); return their paths. QA rows: ``question``, ``answer``; MCQ rows: ``question``,
    options ``A``-``D``, ``answer`` (the letter). Deterministic in ``seed``."""
    from harness.datasets.synthetic import text_tasks

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, tasks in CI_SAMPLE_TASKS.items():
        per_task = [closed_book_items(task, closed_book_count(n), seed) if task in text_tasks.CLOSED_BOOK_TASKS
                    else text_tasks.items(task, "heldout", n, seed) for task in tasks]
        rows = [it.row() for group in zip(*per_task) for it in group]
        path = out / name
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        paths.append(path)
    return paths


def closed_book_count(n: int) -> int:
    """Facts the CI sample asks for ``opencompass.ci_items = n``: ``CLOSED_BOOK_SCALE * n``, at most the whole table
    (90 facts from n = 15 on: a table cannot be asked more distinct facts than it holds)."""
    from harness.datasets.synthetic import text_tasks

    return min(CLOSED_BOOK_SCALE * n, len(text_tasks.RECALL_FACTS))


def closed_book_items(task: str, n: int, seed: int = 0) -> list:
    """``n`` distinct facts of a closed-book task's table, a seeded sample without replacement (``text_tasks.items``
    draws with replacement: a fact asked twice would count twice)."""
    import random

    from harness.datasets.synthetic import text_tasks

    if task not in text_tasks.CLOSED_BOOK_TASKS:
        raise ValueError(f"no fact table for {task!r}; closed-book tasks: {text_tasks.CLOSED_BOOK_TASKS}")
    every = text_tasks.recall_items()
    if n > len(every):
        raise ValueError(f"{n} facts asked of a table of {len(every)}")
    return random.Random(f"ci:{task}:{seed}").sample(every, n)


def staged_path(dataset_path: str, cache_dir: str) -> str:
    """Where OpenCompass reads ``dataset_path`` (a dataset config's ``path``, e.g. ``opencompass/gsm8k``) in
    local mode: ``COMPASS_DATA_CACHE`` joined with the dataset's ``local`` entry (OpenCompass's mapping)."""
    from opencompass.utils.datasets_info import DATASETS_MAPPING

    if os.path.isabs(dataset_path):
        return dataset_path
    local = DATASETS_MAPPING.get(dataset_path, {}).get("local", dataset_path)
    return os.path.normpath(os.path.join(cache_dir, local))


def _download_hint(local: str) -> str:
    from opencompass.utils.datasets_info import DATASETS_URL

    key = "/" + Path(local).name.rstrip("/") + "/"
    url = DATASETS_URL.get(key, {}).get("url")
    return f" (OpenCompass's archive: {url}; unpack it so that this path exists)" if url else ""


def check_staged(datasets: list[dict[str, Any]], cache_dir: str | None) -> None:
    """Refuse datasets whose files are not in the data cache, all of them in one message."""
    if cache_dir is None:
        raise OpenCompassDataMissing(
            "opencompass.data_cache (or the environment variable COMPASS_DATA_CACHE) is not set: real OpenCompass "
            "datasets are read offline from that folder (it holds data/<dataset>/...). Stage them there, or run "
            "the bundled sample with opencompass.suite=ci_sample")
    missing = []
    for ds in datasets:
        path = ds.get("path")
        if not path:
            continue
        local = staged_path(str(path), cache_dir)
        candidates = [local] + [local + ext for ext in (".jsonl", ".json", ".csv")]
        if not any(os.path.exists(c) for c in candidates):
            missing.append(f"{ds.get('abbr', path)}: expected {local}{_download_hint(local)}")
    if missing:
        raise OpenCompassDataMissing(
            f"{len(missing)} OpenCompass dataset(s) not staged in COMPASS_DATA_CACHE={cache_dir}:\n  "
            + "\n  ".join(missing))


class OpenCompassDependencyMissing(RuntimeError):
    """An evaluator of the suite needs a package that is not installed (found before any model loads)."""


# evaluator class name -> (module it imports, how to get it): OpenCompass imports these only when scoring,
# i.e. after the whole inference has run
EVALUATOR_NEEDS = {
    "HumanEvalEvaluator": ("human_eval", "OpenCompass's fork: git clone https://github.com/open-compass/human-eval "
                                         "&& pip install -e human-eval (into .venv-opencompass)"),
}


def check_evaluators(datasets: list[dict[str, Any]]) -> None:
    """Refuse a suite whose evaluators would fail to import after inference has run."""
    import importlib.util

    missing = {}
    for ds in datasets:
        kind = ((ds.get("eval_cfg") or {}).get("evaluator") or {}).get("type", "")
        evaluator = getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1])  # a class, or its dotted name
        for name, (module, how) in EVALUATOR_NEEDS.items():
            if evaluator == name and importlib.util.find_spec(module) is None:
                missing.setdefault(module, (how, []))[1].append(ds.get("abbr", "?"))
    if missing:
        raise OpenCompassDependencyMissing("; ".join(
            f"{', '.join(abbrs)} need the Python module {module!r}: {how}" for module, (how, abbrs) in missing.items()))
