"""Train several embedded-model recipes side by side on one GPU, then evaluate each on the held-out split.

``python benchmarks/train_tiny_v2.py --out $OUT`` (one H200, ≈ 8 minutes wall; ``--smoke`` = a CPU run of a
few steps). Why one script: the lead has one GPU call for the v2 recipe; the tiny model leaves an H200 mostly
idle, so 3-4 recipes (``harness/models/train_recipes.py``) train at once as forked processes sharing one data
pool (built once, before any process touches CUDA). Each child then evaluates its own checkpoint with
:mod:`harness.commands.eval_tiny` — the harness's engine, VisionZip / SERE / top-K code and metrics — so the
numbers are the ones ``tests/run/test_sensitivity.py`` asserts.

Each variant works in ``WORK/<variant>/``: ``ckpt/`` (the harness checkpoint), ``heldout.json`` (held-out
metrics and every answer), ``log.txt``; at the end each is packed into ``OUT/<variant>.tar.gz`` (the device
returns at most 8 files), ``OUT/summary.json`` gathers the headlines and ``OUT/table.md`` / the console show one
table. Each variant has a wall-clock budget (``--train-minutes``; evaluation skips what no longer fits in
``--budget-s``), and one failing variant never loses the others.
Imports only torch / transformers / tokenizers / PIL / numpy and harness modules that need no Hydra.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# the parent forks the CUDA-using children: any torch.cuda.is_available() before that must not initialise the
# CUDA runtime in the parent (PyTorch's NVML-based check exists for this)
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

DEFAULT_VARIANTS = "v2,v2-curriculum,v2-group,v2-all"


def _child(variant: str, train_argv: list[str], pools, out: Path, deadline: float, eval_sizes: dict,
           device: str, threads: int) -> None:
    """One recipe: train (shared pool), save, evaluate; stdout/stderr to ``out/log.txt``."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "log.txt", "w", buffering=1, encoding="utf-8")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ["HARNESS_CACHE"] = f"/tmp/train-tiny-v2-cache/{variant}"  # SERE artefacts: not shipped back
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # 4 processes share the memory
    try:
        import torch

        torch.set_num_threads(threads)
        from harness.models import train_tiny

        t0 = time.time()
        train_tiny.main(train_argv, pools=pools)
        print(f"[{variant}] trained in {time.time() - t0:.0f} s", flush=True)
        import gc
        import subprocess

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        # a fresh process: the harness's code path exactly (training patched the vision tower's helpers)
        cmd = [sys.executable, "-m", "harness.commands.eval_tiny", str(out / "ckpt"), "--out", str(out / "heldout.json"),
               "--device", device, "--deadline", str(deadline)]
        for key, value in eval_sizes.items():
            cmd += [f"--{key.replace('_', '-')}", ",".join(value) if isinstance(value, tuple) else str(value)]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.Popen(cmd, env=env, cwd=str(ROOT))
        signal.signal(signal.SIGTERM, lambda *_: (proc.terminate(), sys.exit(1)))  # the parent's budget stop
        if proc.wait():
            raise RuntimeError(f"evaluation exited with {proc.returncode}")
        from harness.commands.eval_tiny import format_table

        res = json.loads((out / "heldout.json").read_text(encoding="utf-8"))
        info = json.loads((out / "ckpt" / "harness_model.json").read_text(encoding="utf-8"))
        res["expert_usage_tv"] = usage_spread(info.get("expert_usage") or {})
        res["final_ema"] = info.get("final_ema")
        res["time_s"] = info.get("time_s")
        (out / "heldout.json").write_text(json.dumps(res, indent=1, ensure_ascii=False, default=str) + "\n",
                                          encoding="utf-8")
        print(format_table(res["headline"]), flush=True)
    except BaseException:  # noqa: BLE001 - recorded, the parent reports the others
        traceback.print_exc()
        (out / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
        sys.exit(1)


def usage_spread(usage: dict[str, list[float]]) -> dict[str, float]:
    """How much experts specialise: mean pairwise total-variation distance between tasks' expert usage, and
    the largest single-expert share (uniform = 1/E)."""
    tasks = list(usage)
    pairs = [(a, b) for i, a in enumerate(tasks) for b in tasks[i + 1:]]
    tv = [0.5 * sum(abs(x - y) for x, y in zip(usage[a], usage[b])) for a, b in pairs]
    return {"mean_tv_between_tasks": round(sum(tv) / len(tv), 4) if tv else None,
            "max_share": round(max((max(u) for u in usage.values()), default=0.0), 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results/benchmarks/train_tiny_v2")),
                    help="what comes back: summary.json, table.md and one <variant>.tar.gz each (the device "
                         "returns at most 8 files of 16 MiB, 64 MiB in all: 4 variants fit)")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "train_tiny_v2",
                    help="where the variants train and evaluate (packed into --out at the end)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS)
    ap.add_argument("--train-minutes", type=float, default=3.5, help="training time per variant (all in parallel)")
    ap.add_argument("--budget-s", type=float, default=470, help="whole script; evaluation skips what does not fit")
    ap.add_argument("--pool", type=float, default=0.5, help="training pool scale (train_tiny --pool)")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--smoke", action="store_true", help="CPU: a few steps, tiny pool, tiny evaluation")
    ap.add_argument("--summarize", action="store_true",
                    help="no training: rebuild summary.json and the table from OUT/<variant>/heldout.json (after "
                         "`python -m harness.commands.eval_tiny --rescore OUT/<variant>/heldout.json`)")
    args = ap.parse_args(argv)
    if args.summarize:  # --work = the unpacked <variant>/ folders
        variants = [v for v in args.variants.split(",") if (args.work / v).is_dir()]
        summary = gather(args.work, variants, {"rescored_here": True})
        (args.work / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n",
                                                encoding="utf-8")
        print(comparison_table(summary))
        return 0
    t_start = time.time()
    deadline = t_start + args.budget_s
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    variants = [v for v in args.variants.split(",") if v]

    # the data pool, once, before any CUDA call (children are forked)
    from harness.models.tiny import build_config, build_tokenizer
    from harness.models.train_tiny import build_pools, parse_args
    from harness.models.trained import TRAINED_SPEC

    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    common = ["--pool", str(args.pool), "--workers", str(args.workers)]
    if args.smoke:
        common = ["--pool", "0.002", "--workers", str(min(2, args.workers)), "--steps", "3", "--batch-scale", "0.02",
                  "--eval-n", "2", "--device", "cpu"]
    else:
        common += ["--eval-n", "128", "--train-minutes", str(args.train_minutes), "--refit",
                   "--max-minutes", str(args.train_minutes + 0.8)]
    tokenizer = build_tokenizer(TRAINED_SPEC)
    tok_dir = work / "_pool_tokenizer"
    tokenizer.save_pretrained(tok_dir)
    config = build_config(TRAINED_SPEC, tokenizer)
    pools_by_gen: dict[str, tuple] = {}
    t0 = time.time()
    union: dict[str, tuple] = {}  # generator -> (its first variant's args, every task its variants sample)
    for v in variants:
        pa = parse_args(["--variant", v, "--out", str(work / v / "ckpt"), *common])
        union.setdefault(pa.generator, (pa, set()))[1].update(pa.task_weights)
    for gen, (pa, tasks) in union.items():  # one pool per generator, with the union of the tasks (v3 adds two):
        pa.task_weights = {t: 1.0 for t in sorted(tasks)}  # each task's draw is seeded on its own, so a variant
        pools_by_gen[gen] = build_pools(pa, str(tok_dir), config)  # sees the examples it would alone
    data_s = time.time() - t0
    import shutil

    shutil.rmtree(tok_dir, ignore_errors=True)
    print(f"data pools {sorted(pools_by_gen)} in {data_s:.0f} s", flush=True)

    eval_sizes = ({"n_rag": 2, "n_ocr": 3, "n_mcq": 2, "batch_size": 4, "rag_tokens": 8, "sections": ("ocr", "mix")}
                  if args.smoke else
                  {"n_rag": 48, "n_ocr": 96, "n_mcq": 48, "batch_size": 48})
    threads = 1 if args.smoke else max(1, (os.cpu_count() or 4) // max(1, len(variants)))
    import torch

    if torch.cuda.is_initialized():  # forked children could not use CUDA
        raise SystemExit("CUDA was initialised in the parent before forking the variants")
    ctx = mp.get_context("fork")
    procs = {}
    for v in variants:
        pa = parse_args(["--variant", v, "--out", str(work / v / "ckpt"), *common])
        train_argv = ["--variant", v, "--out", str(work / v / "ckpt"), *common]
        p = ctx.Process(target=_child, args=(v, train_argv, pools_by_gen[pa.generator], work / v, deadline - 20,
                                              eval_sizes, "cpu" if args.smoke else "auto", threads), daemon=False)
        p.start()
        procs[v] = p
        print(f"started {v} (pid {p.pid})", flush=True)
    next_report = time.time() + 60
    while any(p.is_alive() for p in procs.values()) and time.time() < deadline:
        time.sleep(2)
        if time.time() >= next_report:  # one line per variant a minute: the last thing its log says
            next_report += 60
            for v in procs:
                log = work / v / "log.txt"
                lines = log.read_text(encoding="utf-8", errors="replace").splitlines() if log.exists() else []
                lines = [ln for ln in lines if ln.startswith(("{", "[", "held-out", "refit", "wrote"))] or lines
                print(f"  {time.time() - t_start:4.0f} s {v}: {(lines[-1] if lines else '')[:160]}", flush=True)
    for v, p in procs.items():
        p.join(timeout=max(1.0, deadline - time.time()))
        if p.is_alive():
            print(f"{v}: past the budget, stopping it", flush=True)
            os.kill(p.pid, signal.SIGTERM)
            p.join(10)
    summary = gather(work, variants, {"data_s": round(data_s, 1), "smoke": args.smoke})
    table = comparison_table(summary)
    packed = pack(work, args.out, variants)
    summary["wall_s"] = round(time.time() - t_start, 1)
    summary["packed"] = packed
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    (args.out / "table.md").write_text(table + "\n", encoding="utf-8")
    print(table)
    print(f"wall {summary['wall_s']} s; packed {packed}", flush=True)
    return 0


def pack(work: Path, out: Path, variants: list[str]) -> dict[str, int]:
    """One ``<variant>.tar.gz`` per variant (ckpt/, heldout.json, log.txt, error.txt): the device returns few
    files. Returns their sizes."""
    import tarfile

    sizes = {}
    for v in variants:
        src = work / v
        if not src.is_dir():
            continue
        dst = out / f"{v}.tar.gz"
        with tarfile.open(dst, "w:gz", compresslevel=1) as tar:
            for item in sorted(src.iterdir()):
                if item.name in ("ckpt", "heldout.json", "log.txt", "error.txt"):
                    tar.add(item, arcname=f"{v}/{item.name}",
                            filter=lambda t: None if "/_tokenizer" in t.name else t)
        sizes[dst.name] = dst.stat().st_size
    return sizes


def gather(out: Path, variants: list[str], extra: dict) -> dict:
    """``summary.json``: each variant's headline (or its error) from ``OUT/<variant>/heldout.json``."""
    summary = {"variants": {}, **extra}
    for v in variants:
        f = out / v / "heldout.json"
        if f.exists():
            res = json.loads(f.read_text(encoding="utf-8"))
            summary["variants"][v] = {"headline": res["headline"], "expert_usage_tv": res.get("expert_usage_tv"),
                                      "train_heldout_accuracy": res.get("train_heldout_accuracy"),
                                      "training": res.get("training"), "time_s": res.get("time_s")}
        else:
            err = out / v / "error.txt"
            summary["variants"][v] = {"error": err.read_text(encoding="utf-8")[-1500:] if err.exists() else "no result"}
            marker = out / v / "ckpt" / "harness_model.json"
            if marker.exists():  # trained, not evaluated: the training-time held-out accuracies still count
                info = json.loads(marker.read_text(encoding="utf-8"))
                summary["variants"][v]["train_heldout_accuracy"] = info.get("heldout_accuracy")
                summary["variants"][v]["expert_usage_tv"] = usage_spread(info.get("expert_usage") or {})
    return summary


def comparison_table(summary: dict) -> str:
    """One row per quantity, one column per variant."""
    vs = list(summary["variants"])
    rows: dict[str, list[str]] = {}

    def f(x):
        return "–" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))

    for i, v in enumerate(vs):
        entry = summary["variants"][v]
        cells: dict[str, str] = {}
        if "error" in entry:
            cells["error"] = entry["error"].strip().splitlines()[-1][:60]
        else:
            cells["steps"] = f((entry.get("training") or {}).get("steps_done"))
            for k, val in entry["headline"].items():
                if isinstance(val, dict):
                    for m in ("rouge1", "edit_score", "kendall", "format_invalid"):
                        cells[f"{k}.{m}"] = f(val.get(m))
                else:
                    cells[k] = f(val)
            tr = entry.get("train_heldout_accuracy") or {}
            for k, val in tr.items():
                cells[f"train_eval.{k}"] = f(val)
            cells["expert_tv_between_tasks"] = f((entry.get("expert_usage_tv") or {}).get("mean_tv_between_tasks"))
        for k, c in cells.items():
            rows.setdefault(k, ["–"] * len(vs))[i] = c
    lines = ["| quantity | " + " | ".join(vs) + " |", "|---|" + "---|" * len(vs)]
    lines += [f"| {k} | " + " | ".join(c) + " |" for k, c in rows.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
