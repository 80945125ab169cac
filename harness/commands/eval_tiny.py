"""Held-out evaluation of a trained embedded-model checkpoint, through the harness's own engine, techniques and
metrics: ``python -m harness.commands.eval_tiny CKPT_DIR [--out JSON] [--quick]``.

Why a separate evaluator: ``tests/run/test_sensitivity.py`` asserts directions on the 12 bundled requests through
``python -m harness`` (Hydra), which a GPU box without Hydra cannot run, and 12 requests are too few to choose
between training recipes. This module measures exactly the quantities those tests assert, on a larger held-out
draw of the checkpoint's own generator version, with the same code paths the run uses — the loaders
(``load_samples``), :class:`~harness.engines.hf.engine.HFEngine` with VisionZip / SERE / ``moe.top_k`` installed from
the config dataclasses, :class:`~harness.metrics.scoring.Scorer` + :func:`~harness.metrics.scoring.aggregate`, and
:func:`~harness.techniques.visionzip.stats.keep_rate_by_source` for the budget competition:

- OCR accuracy at keep 1.0 / 0.5 / 0.25 (the "OCR falls at a small keep" test);
- OCR+CC mix at keep 0.5: per-source keep rate under ``scope=request`` vs ``scope=image``;
- RAG-IGBench Rouge-1 / edit / Kendall / format-invalid for: baseline, VisionZip keep 0.5 / 0.25, SERE K=1 ρ=0,
  + protect 4, SERE K=2 ρ=0, plain ``moe.top_k`` 1 and 2 (SERE vs top-K at the same K);
- MCQ (CCBench circular and per-row accuracy) at keep 1.0 and 0.25;
- the text tasks (recipe v7, :mod:`harness.datasets.synthetic.text_tasks`): held-out accuracy per task with
  OpenCompass's rules, under the OpenCompass table's settings (baseline, SERE K=2 / K=1 at ρ 0.5, K=1 + protect 4,
  plain top-2) — the numbers ``python -m harness.opencompass`` measures on the CI suite, on more items.

The first 12 RAG requests of the draw are the bundled sample's (same generator, seed 0, held-out split).
Imports nothing of Hydra / omegaconf (``harness.config.schema``'s dataclasses work without it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness.datasets import load_samples
from harness.engines.base import Request
from harness.engines.hf.engine import HFEngine
from harness.techniques.visionzip.stats import keep_rate_by_source
from harness.metrics.paired import paired_delta
from harness.metrics.scoring import aggregate, Scorer
from harness.models.load import resolve_device
from harness.models.trained import checkpoint_info, sha256_file

RAG_CONDITIONS: dict[str, dict[str, dict]] = {  # run in this order (most wanted first, see ``deadline``), vz_* last
    "base": {},
    "sere_k1_rho0": {"sere": {"k": 1, "rho": 0.0}},
    "topk_1": {"moe": {"top_k": 1}},
    "sere_k1_rho0_protect4": {"sere": {"k": 1, "rho": 0.0, "protect": 4}},
    "sere_k2_rho0": {"sere": {"k": 2, "rho": 0.0}},
    "topk_2": {"moe": {"top_k": 2}},
    "vz_0.5": {"visionzip": {"keep": 0.5}},
    "vz_0.25": {"visionzip": {"keep": 0.25}},
}
KEEPS = (1.0, 0.5, 0.25)
# the seed's OpenCompass table (issue 28): SERE at ρ 0.5, plain top-2, and K=1's loss with and without protection
TEXT_CONDITIONS: dict[str, dict[str, dict]] = {
    "base": {},
    "sere_k2_rho0.5": {"sere": {"k": 2, "rho": 0.5}},
    "topk_2": {"moe": {"top_k": 2}},
    "sere_k1_rho0.5": {"sere": {"k": 1, "rho": 0.5}},
    "sere_k1_rho0.5_protect4": {"sere": {"k": 1, "rho": 0.5, "protect": 4}},
    # a quarter of the top-4 experts: in proportion, the seed's plain top-2 of Qwen3's top-8
    "topk_1": {"moe": {"top_k": 1}},
}
# OCR under the decode-time MoE techniques (keep 1.0): short answers, so many requests are cheap — a less noisy
# SERE-vs-top-K comparison than 48 long RAG answers, once the model reads (v4)
OCR_MOE_CONDITIONS: dict[str, dict[str, dict]] = {
    "sere_k1_rho0": {"sere": {"k": 1, "rho": 0.0}},
    "topk_1": {"moe": {"top_k": 1}},
    "sere_k1_rho0_protect4": {"sere": {"k": 1, "rho": 0.0, "protect": 4}},
    "sere_k2_rho0": {"sere": {"k": 2, "rho": 0.0}},
    "topk_2": {"moe": {"top_k": 2}},
}


def write_heldout(root: Path, generator: str, n_rag: int, n_ocr: int, n_mcq: int, seed: int = 0) -> dict[str, Any]:
    """Held-out datasets of ``generator`` in the benchmarks' own file formats; returns their dataset configs."""
    from harness.config.schema import DatasetConfig
    from harness.datasets.synthetic import tasks as st
    from harness.datasets.synthetic.rag_igbench import write_rag_igbench
    from harness.datasets.synthetic.ocr_cc import ocr_rows, write_ccbench, write_ocrbench

    st.use_generator(generator)
    rag = write_rag_igbench(root / "rag", st.items("rag", "heldout", n_rag, seed))
    ocr = write_ocrbench(root / "ocr", ocr_rows(st.items("ocr", "heldout", n_ocr, seed)))
    mcq = write_ccbench(root / "mcq", st.items("mcq", "heldout", n_mcq, seed))
    n_mix = min(n_ocr, n_mcq)
    return {
        "rag": DatasetConfig(name="rag_igbench", path=str(rag)),
        "ocr": DatasetConfig(name="ocrbench", path=str(ocr)),
        "mcq": DatasetConfig(name="ccbench", path=str(mcq), circular=True),
        "mix": DatasetConfig(name="ocr_cc_mix", n_per_source=n_mix, images_per_request=2, seed=seed, sources={
            "ocrbench": {"name": "ocrbench", "path": str(ocr)},
            "ccbench": {"name": "ccbench", "path": str(mcq), "circular": False}}),
    }


def run_condition(ckpt: Path, dataset_cfg: Any, *, model_id: str, device: str, batch_size: int,
                  max_new_tokens: int, visionzip: dict | None = None, sere: dict | None = None,
                  moe: dict | None = None) -> dict[str, Any]:
    """One harness run in-process (no Hydra): load → generate → score → aggregate, plus technique statistics."""
    from harness.config.schema import EngineConfig, GenerationConfig, MoeConfig, SereConfig, VisionZipConfig

    vz_cfg = VisionZipConfig(**(visionzip or {}))
    samples = list(load_samples(dataset_cfg))
    engine = HFEngine(str(ckpt), EngineConfig(device=device, dtype="float32", batch_size=batch_size,
                                              experts_implementation=None, cuda_graphs=False, warmup=0),
                      GenerationConfig(max_new_tokens=max_new_tokens), sere_cfg=SereConfig(**(sere or {})),
                      visionzip_cfg=vz_cfg, model_id=model_id, moe_cfg=MoeConfig(**(moe or {})))
    try:
        gens = engine.generate([Request(s.uid, s.content, s.load_images()) for s in samples])
        stats = engine.technique_stats()
    finally:
        engine.close()
    records = [{"uid": s.uid, "task": s.task, "dataset": s.dataset, "error": g.error, "answer": g.text,
                "error_kind": "engine" if g.error else None, "error_reason": None, "meta": s.meta,
                "visionzip": g.extra.get("visionzip")} for s, g in zip(samples, gens)]
    out: dict[str, Any] = {"errors": sum(1 for r in records if r["error"]),
                           "answers": {r["uid"]: r["answer"] for r in records}}  # kept: rescoring needs only these
    try:  # the RAG metrics need jieba / rapidfuzz, absent on a bare GPU box: the answers survive, rescore later
        out["metrics"] = score(samples, records)
    except ImportError as e:
        out["scoring_error"] = f"{type(e).__name__}: {e} (rescore: python -m harness.commands.eval_tiny --rescore JSON)"
    if vz_cfg.keep < 1.0:  # the same per-source reading as harness.run.summary_blocks.visionzip_summary
        per = [(r["meta"].get("image_sources") or [r["meta"].get("source") or r["dataset"]]
                * len(r["visionzip"]["tokens_per_image"]), r["visionzip"]["tokens_per_image"],
                r["visionzip"]["kept_per_image"]) for r in records if r["visionzip"]]
        kept, total = sum(sum(k) for *_, k in per), sum(sum(t) for _, t, _ in per)
        out["visionzip"] = {"keep_rate": kept / total if total else None, "by_source": keep_rate_by_source(per)}
    for name in ("sere", "moe"):
        if name in stats:
            out[name] = {k: v for k, v in stats[name].items() if k != "per_layer"}
    return out


def run_text_condition(ckpt: Path, text_items: dict[str, list], *, model_id: str, device: str, batch_size: int,
                       max_new_tokens: int = 12, sere: dict | None = None, moe: dict | None = None) -> dict[str, Any]:
    """The text tasks through the HF engine (one user turn, the prompt OpenCompass sends), scored with
    OpenCompass's rules (:func:`text_tasks.correct`); accuracy per task and their unweighted mean."""
    from harness.config.schema import EngineConfig, GenerationConfig, MoeConfig, SereConfig, VisionZipConfig
    from harness.datasets.synthetic import text_tasks

    flat = [(task, i, it) for task, its in text_items.items() for i, it in enumerate(its)]
    engine = HFEngine(str(ckpt), EngineConfig(device=device, dtype="float32", batch_size=batch_size,
                                              experts_implementation=None, cuda_graphs=False, warmup=0),
                      GenerationConfig(max_new_tokens=max_new_tokens), sere_cfg=SereConfig(**(sere or {})),
                      visionzip_cfg=VisionZipConfig(), model_id=model_id, moe_cfg=MoeConfig(**(moe or {})))
    try:
        gens = engine.generate([Request(f"{task}-{i}", [{"type": "text", "text": it.prompt}], [])
                                for task, i, it in flat])
        stats = engine.technique_stats()
    finally:
        engine.close()
    right: dict[str, list[bool]] = {t: [] for t in text_items}
    for (task, _, it), g in zip(flat, gens):
        right[task].append(not g.error and text_tasks.correct(it, g.text))
    acc = {t: sum(v) / len(v) for t, v in right.items() if v}
    suite = [v for t, v in acc.items() if t in text_tasks.TEXT_TASKS] or list(acc.values())
    out: dict[str, Any] = {"metrics": {**acc, "average": sum(suite) / len(suite)},  # the OpenCompass tasks' mean
                           "errors": sum(1 for g in gens if g.error),
                           "answers": {f"{t}-{i}": g.text for (t, i, _), g in zip(flat, gens)},
                           "correct": {t: [int(v) for v in right[t]] for t in right},  # per item, for paired deltas
                           "tpot_ms_median": _median([g.tpot_ms for g in gens if g.tpot_ms is not None])}
    for name in ("sere", "moe"):
        if name in stats:
            out[name] = {k: v for k, v in stats[name].items() if k != "per_layer"}
    return out


def text_items_for(info: dict[str, Any], n_text: int) -> dict[str, list]:
    """The text section's items: ``n_text`` held-out items of each OpenCompass text task and, where the checkpoint
    was taught the closed-book fact table (its recorded task weights train ``text_recall``), every fact once —
    a checkpoint never taught the facts would score 0 on them, which says nothing about a technique."""
    from harness.datasets.synthetic import text_tasks

    items = {t: text_tasks.items(t, "heldout", n_text) for t in text_tasks.TEXT_TASKS}
    if ((info.get("training") or {}).get("task_weights") or {}).get("text_recall"):
        items["text_recall"] = text_tasks.recall_items()
    return items


def _median(xs: list[float]) -> float | None:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def score(samples: list, records: list[dict]) -> dict[str, Any]:
    """``aggregate`` of the harness's per-sample scores (records carry uid, answer, error)."""
    from harness.config.schema import ScoringConfig

    scorer = Scorer(ScoringConfig(clip_model=None, embed_model=None))
    by_uid = {s.uid: s for s in samples}
    for r in records:
        r["scores"] = scorer(by_uid[r["uid"]], "" if r["error"] else r["answer"], r["error"])
    return aggregate(records)


def rescore(results: dict[str, Any]) -> dict[str, Any]:
    """Re-score a results JSON's stored answers here (same generator, same held-out draw, same metrics) —
    for a GPU run whose box lacked the metric packages. Updates ``metrics`` and ``headline`` in place."""
    n = results["n"]
    with tempfile.TemporaryDirectory(prefix="tiny-heldout-") as tmp:
        data = write_heldout(Path(tmp), results["generator_version"], n["rag"], n["ocr"], n["mcq"])
        for section in ("ocr", "mix", "rag", "mcq"):
            if section not in results:
                continue
            samples = list(load_samples(data[section]))
            for res in results[section].values():
                if "answers" not in res:
                    continue
                records = [{"uid": s.uid, "task": s.task, "dataset": s.dataset, "answer": res["answers"].get(s.uid, ""),
                            "error": None if s.uid in res["answers"] else "missing", "error_kind": None,
                            "error_reason": None} for s in samples]
                res["metrics"] = score(samples, records)
                res.pop("scoring_error", None)
    results["headline"] = headline(results)
    return results


def _rag_row(res: dict) -> dict:
    m = res["metrics"]
    return {k: (round(m[k], 4) if isinstance(m.get(k), float) else m.get(k))
            for k in ("rouge1", "edit_score", "kendall", "format_invalid", "n_samples")}


def headline(results: dict[str, Any]) -> dict[str, Any]:
    """The numbers the sensitivity tests assert, flat (``None`` where a section failed)."""
    def get(path: list[str]):
        node: Any = results
        for p in path:
            if not isinstance(node, dict) or p not in node:
                return None
            node = node[p]
        return node

    h: dict[str, Any] = {}
    for keep in KEEPS:
        h[f"ocr_acc_keep{keep}"] = get(["ocr", f"keep{keep}", "metrics", "ocrbench_accuracy"])
    for name in OCR_MOE_CONDITIONS:
        h[f"ocr_acc_{name}"] = get(["ocr", name, "metrics", "ocrbench_accuracy"])
    for keep in (1.0, 0.25):
        h[f"mcq_acc_keep{keep}"] = get(["mcq", f"keep{keep}", "metrics", "mcq_accuracy"])
        h[f"mcq_row_acc_keep{keep}"] = get(["mcq", f"keep{keep}", "metrics", "mcq_row_accuracy"])
    for scope in ("request", "image"):
        src = get(["mix", scope, "visionzip", "by_source"]) or {}
        text, sparse = (src.get("ocrbench") or {}).get("keep_rate"), (src.get("ccbench") or {}).get("keep_rate")
        h[f"mix_{scope}_text_keep"], h[f"mix_{scope}_sparse_keep"] = text, sparse
        h[f"mix_{scope}_gap_text_minus_sparse"] = (text - sparse) if None not in (text, sparse) else None
    for name in TEXT_CONDITIONS:
        h[f"text_{name}"] = get(["text", name, "metrics", "average"])
        recall = get(["text", name, "metrics", "text_recall"])
        if recall is not None:  # a checkpoint taught the closed-book table (text_items_for)
            h[f"text_recall_{name}"] = recall
    for name in RAG_CONDITIONS:
        res = get(["rag", name])
        h[f"rag_{name}"] = _rag_row(res) if res and "metrics" in res else None
    return h


def evaluate_checkpoint(ckpt: Path, *, device: str = "auto", n_rag: int = 48, n_ocr: int = 96, n_mcq: int = 48,
                        batch_size: int = 48, rag_tokens: int = 192,
                        sections: tuple[str, ...] = ("text", "ocr", "mix", "rag", "mcq"), n_text: int = 64, deadline: float | None = None,
                        log=print, out: Path | None = None) -> dict[str, Any]:
    """Every condition guarded: one failure is recorded and the rest still runs; past ``deadline`` (a
    ``time.time()`` value) the remaining conditions are recorded as skipped; ``out`` is rewritten after every
    condition, so a run stopped from outside keeps what it measured."""
    import traceback

    ckpt = Path(ckpt)
    info = checkpoint_info(ckpt)
    device = resolve_device(device)
    generator = str(info.get("generator_version", "1"))
    model_id = f"{ckpt.resolve()}@{sha256_file(ckpt / 'model.safetensors')[:16]}"
    results: dict[str, Any] = {"checkpoint": str(ckpt), "generator_version": generator, "device": device,
                               "n": {"rag": n_rag, "ocr": n_ocr, "mcq": n_mcq}, "dtype": "float32",
                               "weights": info.get("weights"), "training": {k: info.get("training", {}).get(k) for k in
                                                                            ("variant", "steps_done", "aux", "curriculum",
                                                                             "expert_groups")},
                               "train_heldout_accuracy": info.get("heldout_accuracy")}
    common = {"model_id": model_id, "device": device, "batch_size": batch_size}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="tiny-heldout-") as tmp:
        data = write_heldout(Path(tmp), generator, n_rag, n_ocr, n_mcq)
        plan: list[tuple[str, str, dict]] = []
        if "text" in sections:  # first: the OpenCompass table's conditions are short, and v7 is about them
            text_items = text_items_for(info, n_text)
            plan += [("text", name, {"text_items": text_items, **over}) for name, over in TEXT_CONDITIONS.items()]
        if "ocr" in sections:
            plan += [("ocr", f"keep{k}", {"dataset_cfg": data["ocr"], "max_new_tokens": 16,
                                          "visionzip": {"keep": k}}) for k in KEEPS]
        if "mix" in sections:
            plan += [("mix", s, {"dataset_cfg": data["mix"], "max_new_tokens": 2,
                                 "visionzip": {"keep": 0.5, "scope": s}}) for s in ("request", "image")]
        rag = [("rag", name, {"dataset_cfg": data["rag"], "max_new_tokens": rag_tokens, **over})
               for name, over in RAG_CONDITIONS.items()] if "rag" in sections else []
        plan += [c for c in rag if not c[1].startswith("vz_")]
        if "ocr" in sections:
            plan += [("ocr", name, {"dataset_cfg": data["ocr"], "max_new_tokens": 16, **over})
                     for name, over in OCR_MOE_CONDITIONS.items()]
        if "mcq" in sections:
            plan += [("mcq", f"keep{k}", {"dataset_cfg": data["mcq"], "max_new_tokens": 4, "visionzip": {"keep": k}})
                     for k in (1.0, 0.25)]
        plan += [c for c in rag if c[1].startswith("vz_")]  # last: the slowest, and v1 already shows them
        for section, name, kwargs in plan:
            t = time.time()
            if deadline is not None and t > deadline:
                results.setdefault(section, {})[name] = {"error": "skipped: past the time budget"}
                continue
            try:
                res = (run_text_condition(ckpt, **common, **kwargs) if section == "text" else
                       run_condition(ckpt, **common, **kwargs))
            except Exception as e:  # noqa: BLE001 - one failing condition must not lose the others
                res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
            res["wall_s"] = round(time.time() - t, 1)
            results.setdefault(section, {})[name] = res
            log(f"[eval] {section}/{name}: {json.dumps(_brief(section, res), ensure_ascii=False)}")
            if out is not None:
                write_results(out, {**results, "headline": headline(results), "partial": True})
    if "text" in results:
        results["text_vs_base"] = text_vs_base(results["text"])
    results["headline"] = headline(results)
    results["wall_s"] = round(time.time() - t0, 1)
    return results


def text_vs_base(text: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each text condition against the baseline, per task: the paired difference in accuracy over the same items
    (:func:`harness.metrics.paired.paired_delta`: bootstrap interval, Wilcoxon p, verdict). Why: a 3-item drop out of
    90 and a 41-item one read alike as "lower" without an interval, and the items are shared, so the pairing removes
    the between-item spread."""
    base = (text.get("base") or {}).get("correct")
    if not base:
        return {}
    out: dict[str, dict[str, Any]] = {}
    for name, res in text.items():
        got = res.get("correct") if name != "base" else None
        if got:
            out[name] = {t: paired_delta(got[t], base[t]) for t in base if t in got and len(got[t]) == len(base[t])}
    return out


def write_results(path: Path, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(results, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
    tmp.replace(path)


def _brief(section: str, res: dict) -> Any:
    if "error" in res:
        return res["error"]
    if "metrics" not in res:
        return res.get("scoring_error")
    m = res["metrics"]
    if section == "rag":
        return _rag_row(res)
    if section == "ocr":
        return {"acc": m.get("ocrbench_accuracy"), "keep_rate": (res.get("visionzip") or {}).get("keep_rate")}
    if section == "text":
        return {k: round(v, 3) for k, v in m.items()}
    if section == "mcq":
        return {"acc": m.get("mcq_accuracy"), "row_acc": m.get("mcq_row_accuracy")}
    return {k: round(v["keep_rate"], 3) for k, v in (res.get("visionzip") or {}).get("by_source", {}).items()}


def format_table(h: dict[str, Any]) -> str:
    """The headline as a markdown table (the docs' and the adoption script's)."""
    def f(x):
        return "–" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))

    lines = ["| quantity | value |", "|---|---|"]
    for k, v in h.items():
        if not k.startswith("rag_"):
            lines.append(f"| {k} | {f(v)} |")
    lines += ["", "| RAG condition | Rouge-1 | edit | Kendall | format-invalid | n |", "|---|---|---|---|---|---|"]
    for k, v in h.items():
        if k.startswith("rag_"):
            v = v or {}
            lines.append(f"| {k[4:]} | {f(v.get('rouge1'))} | {f(v.get('edit_score'))} | {f(v.get('kendall'))} | "
                         f"{f(v.get('format_invalid'))} | {f(v.get('n_samples'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", type=Path, nargs="?", help="checkpoint directory (not with --rescore)")
    ap.add_argument("--rescore", type=Path, default=None,
                    help="re-score the answers stored in this results JSON (written back in place)")
    ap.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--quick", action="store_true", help="CPU-sized: 12 RAG / 24 OCR / 12 MCQ requests")
    ap.add_argument("--sections", default="text,ocr,mix,rag,mcq")
    ap.add_argument("--n-text", type=int, default=64, help="held-out items per text task")
    ap.add_argument("--n-rag", type=int, default=48)
    ap.add_argument("--n-ocr", type=int, default=96)
    ap.add_argument("--n-mcq", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument("--rag-tokens", type=int, default=192)
    ap.add_argument("--deadline", type=float, default=None, help="time.time() after which conditions are skipped")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.rescore:
        res = rescore(json.loads(args.rescore.read_text(encoding="utf-8")))
        args.rescore.write_text(json.dumps(res, indent=1, ensure_ascii=False, default=str) + "\n", encoding="utf-8")
        print(format_table(res["headline"]))
        return 0
    sizes = {"n_rag": args.n_rag, "n_ocr": args.n_ocr, "n_mcq": args.n_mcq, "batch_size": args.batch_size,
             "n_text": args.n_text}
    if args.quick:
        sizes = {"n_rag": 12, "n_ocr": 24, "n_mcq": 12, "batch_size": 12, "n_text": 16}
    res = evaluate_checkpoint(args.ckpt, device=args.device, sections=tuple(args.sections.split(",")),
                              rag_tokens=args.rag_tokens, deadline=args.deadline, out=args.out, **sizes)
    if args.out:
        write_results(args.out, res)
    print(format_table(res["headline"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
