"""One experiment, end to end: dataset → prompts → engine → answers → scores → result files → W&B.

Read top to bottom, this is the whole path a number takes. Nothing here is engine- or dataset-specific:
loaders, engines and scorers come from their registries.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from harness.datasets.base import DatasetError
from harness.engines.base import TechniqueNotAvailable  # noqa: F401 (also importable from here)
from harness.models.load import resolve_model  # noqa: F401 (also importable from here)
from harness.datasets import load_samples
from harness.engines import make_engine
from harness.engines.base import Request
from harness.latency.device_lock import device_key, DeviceLock
from harness.latency.paired import PairedTiming
from harness.latency.runner import TimedBatches
from harness.latency.shapes import technique_state
from harness.latency.variants import paired_variants
from harness.metrics.scoring import aggregate, Scorer
from harness.results.schema import run_block, utc_now, write_summary, SamplesLog
from harness.results.tracking import log_run, start_run, sweep_info
from harness.run.cache import generation_from_cache, key_for, model_key, GenerationCache
from harness.run.logs import run_logging
from harness.run.outcome import parsed_answer, prompt_record, run_warnings
from harness.run.rerun import archive_if_changed
from harness.run.rules_files import validate_files, validate_model_files
from harness.run.summary_blocks import run_latency, visionzip_summary
from harness.run.state import (
    begin_attempt, check_storage, mark_failed, mark_finished, mark_wandb_logged, read_state, storage_error,
    wandb_pending, RunLock, WRITE_ERRNOS)
from harness.run.technique_stats import batch_record, merge_replayed, snapshot
from harness.run.validate import validate_config, validate_model

log = logging.getLogger(__name__)


def _check_sere_engaged(run_dir: Path, state: dict[str, Any], technique_stats: dict[str, Any]) -> None:
    """The SERE engagement canary (``harness.techniques.sere.graphs``): a run with SERE on whose decode tokens
    were not all re-routed fails (run state ``failed`` with the reason) instead of reporting a stock run as SERE."""
    from harness.techniques.sere.graphs import SereNotEngaged, check_engagement

    try:
        check_engagement(technique_stats)
    except SereNotEngaged as e:
        mark_failed(run_dir, state, str(e), sere_engagement=technique_stats["sere"]["engagement"])
        log.error("SERE not engaged: %s", e)
        raise


class NothingScored(DatasetError):
    """Every sample of the run failed for data reasons: there is no score, so the run must not look scored (the CLI
    prints this one line and exits 2, as for data refused before the model loaded; a sweep records the job failed)."""


def all_data_errors(records: list[dict[str, Any]]) -> str | None:
    """One line when every record failed for a data reason (a missing or undecodable image, a defective row): the
    count, the reasons and the first error; None when at least one sample was generated or failed otherwise."""
    if not records or any(r.get("error_kind") != "data" for r in records):
        return None
    reasons: dict[str, int] = {}
    for r in records:
        reasons[r.get("error_reason") or "unknown"] = reasons.get(r.get("error_reason") or "unknown", 0) + 1
    first = str(records[0].get("error") or "")
    first = first if len(first) <= 200 else first[:199] + "…"
    return (f"all {len(records)} samples failed for data reasons ("
            + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
            + f"; first: {records[0].get('uid')}: {first}): nothing was scored")


def finished_summary(run_dir: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``summary.json`` already in ``run_dir`` when it was written for this very configuration (a resumed
    sweep re-enters its finished jobs' directories), else None."""
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return summary if summary.get("config") == json.loads(json.dumps(config)) else None


CACHE_READ = ("resume", "always", "never")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``samples.jsonl`` (a torn last line of a killed writer is skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _finish_wandb(cfg: Any, run_dir: Path, config: dict[str, Any], summary: dict[str, Any], state: dict[str, Any],
                  ) -> dict[str, Any]:
    """Redo the W&B logging of a finished run whose attempt was killed while logging (``summary.json`` written,
    ``run_state.json`` ``wandb.logged`` false): the same W&B run id, from the files in the directory."""
    log.warning("%s: finished earlier but its W&B logging did not complete: logging it now", run_dir)
    wandb_dir = log_run(cfg.wandb, config, summary, read_records(run_dir / "samples.jsonl"), run_dir,
                        name=run_dir.name, run_id=(state.get("wandb") or {}).get("id"))
    if wandb_dir:
        summary["run"]["wandb_dir"] = wandb_dir
        write_summary(run_dir / "summary.json", summary)
    mark_wandb_logged(run_dir, state, wandb_dir)
    return summary


def run_experiment(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Run the configured experiment, write ``config.yaml``, ``samples.jsonl``, ``summary.json``.

    The run directory is locked for the whole run (:class:`harness.run.state.RunLock`; a second process gets
    :class:`~harness.run.state.RunDirLocked`), and its ``run_state.json`` records the attempt before anything
    else, so a rerun after a kill at any point resumes (see :mod:`harness.run.state`)."""
    from omegaconf import OmegaConf

    from harness.run.progress import RunProgress

    validate_config(cfg)  # harness/run/validate.py: every key's range / enumeration, unknown keys, cross-key rules

    validate_files(cfg)  # every file the run reads (artifacts, traces, predictors, scorer models), read and checked

    # latency.sequential: jobs take turns; built here, so an unsafe lock directory (UnsafeLockDir) stops the run
    # before its state, W&B run or progress bar starts
    device_lock = DeviceLock(device_key(str(cfg.engine.device)), sequential=bool(cfg.latency.sequential),
                             timeout_s=cfg.latency.lock_timeout_s)
    started = utc_now()
    config = OmegaConf.to_container(cfg, resolve=True)
    if cfg.cache.read not in CACHE_READ:
        raise ValueError(f"cache.read={cfg.cache.read!r}: expected one of {', '.join(CACHE_READ)}")

    done = check_storage(cfg, run_dir, lambda: finished_summary(run_dir, config))  # StorageError, exit 2
    if done is not None:  # a finished run on read-only media: read, not run again
        return done
    with RunLock(run_dir), run_logging(run_dir):
        archive_if_changed(run_dir, config)  # another configuration's run here: to previous/N, said on the console
        if cfg.cache.enabled and cfg.cache.read != "never":
            done = finished_summary(run_dir, config)
            state = read_state(run_dir)
            if state is not None and state.get("status") == "failed":  # e.g. nothing scored: run it again
                done = None
            if done is not None:
                if state is not None and state.get("status") == "running":  # killed between the two writes
                    mark_finished(run_dir, state)
                if state is not None and wandb_pending(state, cfg.wandb.mode):
                    return _finish_wandb(cfg, run_dir, config, done, state)
                log.warning("%s: finished earlier with this configuration, not run again (cache.read=never "
                            "re-runs it)", run_dir)
                return done
        state, resuming = begin_attempt(run_dir)
        read_cache = cfg.cache.read == "always" or (cfg.cache.read == "resume" and resuming)
        log.info("%s: attempt %d%s, cache %s", run_dir, state["attempt"], " (resuming an interrupted attempt)"
                 if resuming else "", "read" if read_cache and cfg.cache.enabled else "not read")
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config), encoding="utf-8")
        live = _start_wandb(cfg, config, run_dir, state)
        progress = RunProgress(f"{cfg.engine.name} · {cfg.dataset.name}")
        try:
            with device_lock:
                summary = _run(cfg, run_dir, config, started, read_cache, progress, state, live, device_lock)
        except OSError as e:  # a full disk or a directory gone read-only mid-run: one line, exit 2 (state: running)
            if live is not None:
                live.fail()
            err = storage_error(e, run_dir, resume="the rerun resumes from the generation cache", errnos=WRITE_ERRNOS)
            if err is e:
                raise
            raise err from e
        except BaseException:
            if live is not None:
                live.fail()
            raise
        finally:
            progress.close()
    return summary


def _start_wandb(cfg: Any, config: dict[str, Any], run_dir: Path, state: dict[str, Any]):
    """The live W&B run of this attempt (None when disabled), opened before any data or model loads."""
    return start_run(cfg.wandb, config, run_dir, name=run_dir.name, run_id=(state.get("wandb") or {}).get("id"),
                     sweep=sweep_info())


def run_paired(cfg: Any, engine: Any, runnable: list[tuple[Any, Any]], progress: Any) -> Any:
    """``latency.paired=true``: after the scored pass, the technique, the baseline and ``latency.paired_with``'s
    trivial baselines timed alternating on the same batches (:class:`harness.latency.paired.PairedTiming`, whose
    ``summary()`` gives ``latency.paired`` and ``comparisons``); None when off or nothing is left to time."""
    if not cfg.latency.get("paired") or not runnable:
        progress.skip("paired")
        return None

    variants = paired_variants(engine, cfg, list(cfg.latency.get("paired_with") or []))
    # at least one warm-up round per variant: a side that pays a first call would bias the pair
    paired = PairedTiming(engine, cfg.latency, variants, warmup_rounds=max(1, int(cfg.engine.warmup)))
    bs = max(1, cfg.engine.batch_size)
    batches = [[r for _, r in runnable[i: i + bs]] for i in range(0, len(runnable), bs)]
    with progress.phase("paired", total=paired.rounds * len(variants) * len(runnable)) as bar:
        bar.set_postfix_str(" vs ".join(v.name for v in variants))
        paired.warm_up(batches)
        paired.run(batches, bar)
    return paired


def _run(cfg: Any, run_dir: Path, config: dict[str, Any], started: str, read_cache: bool, progress: Any,
         state: dict[str, Any], live: Any = None, device_lock: Any = None) -> dict[str, Any]:
    """The run proper, phase by phase (``progress`` shows them): data → model → images → cache → warmup →
    generate → finish."""
    from omegaconf import OmegaConf

    with progress.phase("data") as bar:
        samples = []
        for sample in load_samples(cfg.dataset):
            samples.append(sample)
            bar.update(1)
    if not samples:
        raise ValueError(f"dataset {cfg.dataset.name!r} produced no samples (check dataset.split / limit)")
    with progress.phase("model", unit="step"):
        model_path, model_info = resolve_model(cfg.model)
        # values the checkpoint's config.json decides, before weights load (a shapes model: its config dict)
        facts = validate_model(cfg, model_path, model_info.pop("config", None))

        validate_model_files(cfg, facts)  # the artifacts' expert counts against the checkpoint's
        extra = ({"sere_cfg": cfg.sere, "visionzip_cfg": cfg.visionzip, "moe_cfg": cfg.moe,
                  "model_id": model_info["name"]}
                 if cfg.engine.name in ("hf", "vllm") else {})
        if model_path.startswith("shapes:"):  # harness/models/real_shapes.py: built by the HF engine
            extra.update(shapes_cfg=cfg.model.shapes, seed=cfg.model.seed)
        if cfg.engine.name == "hf" and cfg.get("offload") is not None and cfg.offload.policy is not None:
            extra["offload_cfg"] = cfg.offload  # expert offload (harness/techniques/offload; docs/offload.md)
        if cfg.engine.name == "vllm":
            extra.update(load_cfg=cfg.load, max_images_per_prompt=cfg.model.max_images_per_prompt, seed=cfg.seed)
            if cfg.load.get("endpoint") is not None:  # vllm serve: its log goes to the run directory
                extra["run_dir"] = str(run_dir)
        try:
            engine = make_engine(cfg.engine.name, model_path, cfg.engine, cfg.generation,
                                 trust_remote_code=cfg.model.trust_remote_code, **extra)
        except NotImplementedError as e:  # a technique setting this engine cannot honour
            raise TechniqueNotAvailable(str(e)) from e

    cache = GenerationCache(cfg.cache.path, read=read_cache) if cfg.cache.enabled else None
    cache_model_id = model_key(model_info, model_path, engine.describe()) if cache is not None else ""
    cache_generation = {**OmegaConf.to_container(cfg.generation, resolve=True),
                        **({"seed": cfg.seed} if cfg.generation.do_sample else {})}
    cache_techniques = {"visionzip": cfg.visionzip, "sere": cfg.sere,
                        **({"moe": cfg.moe} if cfg.moe.top_k is not None or cfg.moe.get("routing") else {})}

    scorer = Scorer(cfg.scoring)
    samples_log = SamplesLog(run_dir / "samples.jsonl")
    records: list[dict[str, Any]] = []
    wall0 = time.perf_counter()

    def record(sample, gen=None, error: str | None = None, uid: str | None = None) -> None:
        error = error or (gen.error if gen else None)
        answer = gen.text if gen and not error else ""
        scores = scorer(sample, answer, error)
        rec = {
            "uid": uid or sample.uid,
            "dataset": sample.dataset,
            "task": sample.task,
            "n_images": len(sample.images),
            "prompt_tokens": gen.prompt_tokens if gen else None,
            "visual_tokens": gen.visual_tokens if gen else None,
            "output_tokens": gen.output_tokens if gen else None,
            **prompt_record(sample),  # the prompt the model saw (text, image markers) and its SHA-256
            "reference": sample.reference,
            "answer": answer,
            "parsed_answer": parsed_answer(sample, answer, scores),
            "scores": scores,
            "ttft_ms": gen.ttft_ms if gen else None,
            "tpot_ms": gen.tpot_ms if gen else None,
            "e2e_ms": gen.e2e_ms if gen else None,
            "itl_ms": gen.extra.get("itl_ms") if gen else None,  # load mode: gaps between streamed chunks
            "error": error,
            # "data": the row or its image is defective (error_reason: a harness.datasets.faults.REASONS key);
            # "engine": generation (or anything else in the run) failed
            "error_kind": ("data" if sample.error_reason or sample.error else "engine") if error else None,
            "error_reason": sample.error_reason if error else None,
            "cached": bool(gen and gen.extra.get("cached")),  # replayed from the generation cache: no timings
            "timing": gen.extra.get("timing") if gen else None,  # latency protocol: re-timed / excluded, and why
            "visionzip": gen.extra.get("visionzip") if gen else None,
            "meta": sample.meta,
        }
        records.append(rec)
        samples_log.write(rec)
        if error:  # the log file names each failure; the console summary counts them
            log.info("sample %s failed: %s", rec["uid"], error)

    def live_progress(chunk: list[Any]) -> None:  # W&B, per batch: a killed run still shows how far it got
        if live is None:
            return
        timed = [g for g in chunk if g is not None and not g.error and g.ttft_ms is not None]
        values = {"progress/samples_done": len(records), "progress/samples_total": len(samples),
                  "progress/errors": sum(1 for r in records if r["error"]),
                  "progress/replayed": sum(1 for r in records if r["cached"])}
        if timed:
            values["batch/ttft_ms"] = sum(g.ttft_ms for g in timed) / len(timed)
            tpots = [g.tpot_ms for g in timed if g.tpot_ms is not None]
            if tpots:
                values["batch/tpot_ms"] = sum(tpots) / len(tpots)
            values["batch/size"] = len(chunk)
        live.log(values)

    pass1_stats = None  # technique statistics of the first (scored) pass, taken before any repeat
    replayed_stats: list[Any] = []  # each replayed entry's batch SERE sums (harness/run/technique_stats.py)
    generated_stats: list[Any] | None = None  # each generated batch's (None: not kept, e.g. no cache)
    try:
        runnable: list[tuple[Any, Request]] = []
        with progress.phase("images", total=len(samples)) as bar:
            for sample in samples:
                bar.update(1)
                if sample.error:
                    record(sample, error=sample.error)
                    continue
                try:
                    runnable.append((sample, Request(sample.uid, sample.content, sample.load_images())))
                except Exception as e:  # noqa: BLE001 - a bad image costs its sample, never the run
                    record(sample, error=f"{type(e).__name__}: {e}")
        all_runnable = list(runnable)  # paired timing (latency.paired) times every request, replayed or not
        keys: dict[str, str] = {}
        n_replayed = 0
        if cache is None:
            progress.skip("cache")
        else:  # keys for writing; when reading, replay hits and generate only the misses
            with progress.phase("cache", total=len(runnable)) as bar:
                todo = []
                for sample, req in runnable:
                    keys[sample.uid] = key_for(cache_model_id, req, cache_generation, cache_techniques)
                    hit = cache.get(keys[sample.uid])
                    if hit is None:
                        todo.append((sample, req))
                    else:
                        record(sample, generation_from_cache(hit, sample.uid))
                        replayed_stats.append((hit.get("extra") or {}).get("sere_batch"))
                        n_replayed += 1
                    bar.update(1)
                runnable = todo
            if n_replayed:
                log.info("%d of %d samples replayed from the generation cache %s", n_replayed,
                         len(samples), cache.path)
        live_progress([])
        bs = max(1, cfg.engine.batch_size)
        # the measurement protocol (harness/latency/, latency.*): warm-up per shape, verified timed batches, repeats

        timer = TimedBatches(engine, cfg.latency, technique_state(cfg), warmup_rounds=cfg.engine.warmup)
        load_mode = cfg.load.qps is not None
        batches = [runnable[i : i + bs] for i in range(0, len(runnable), bs)]
        with progress.phase("warmup", unit="batch") as bar:
            # load mode: its first batch's requests only (vLLM streams one); otherwise one batch per shape key
            warm = [[r for _, r in b] for b in (batches[:1] if load_mode else batches)]
            chosen = [0][:len(warm)] if load_mode and cfg.engine.warmup > 0 and hasattr(engine, "warmup") \
                else timer.plan(warm)
            bar.total = len(chosen) * max(0, cfg.engine.warmup)
            bar.refresh()
            timer.warm_up(warm, chosen, bar)
        gen0 = time.perf_counter()
        load_info = None
        with progress.phase("generate", total=len(runnable)) as bar:
            if n_replayed:
                bar.set_postfix_str(f"{n_replayed} replayed from the cache")
            if cfg.load.qps is not None and runnable:  # serving latency: Poisson arrivals at load.qps
                by_uid = {s.uid: s for s, _ in runnable}
                gens, load_info = engine.run_load([r for _, r in runnable], cfg.load)
                for gen in gens:  # requests cycle through the dataset: uid#k is the k-th pass over uid
                    record(by_uid[gen.extra.get("source_uid", gen.uid)], gen, uid=gen.uid)
                bar.update(len(runnable))
                live_progress(gens)
                runnable = []
            # SERE sums per batch, kept with the cache entries for a resume (the HF engine counts per layer)
            track = cache is not None and cfg.sere.k is not None and cfg.engine.name == "hf"
            generated_stats = [] if track else None
            for bi, chunk in enumerate(batches if runnable else []):
                before = snapshot(engine) if track else None
                gens = timer.time_batch([r for _, r in chunk], 0, bi)  # re-timed when it compiled (latency.on_compile)
                if track:  # one pass's sums (a batch re-timed by the latency protocol ran 1 + retimed times)
                    calls = 1 + max([(g.extra.get("timing") or {}).get("retimed", 0) for g in gens] or [0])
                    sere_batch = batch_record(before, snapshot(engine), [keys[s.uid] for s, _ in chunk], calls)
                    generated_stats.append(sere_batch)
                for (sample, _), gen in zip(chunk, gens):
                    if cache is not None and not gen.error:
                        if track and sere_batch is not None:
                            gen.extra["sere_batch"] = sere_batch
                        cache.put(keys[sample.uid], gen)
                    record(sample, gen)
                bar.update(len(chunk))
                live_progress(gens)
        gen_s = load_info["duration_s"] if load_info else time.perf_counter() - gen0
        pass1_stats = engine.technique_stats() if hasattr(engine, "technique_stats") else {}  # the scored pass's
        timed = batches if runnable else []
        if cfg.latency.repeats > 1 and timed:
            with progress.phase("repeats", total=(cfg.latency.repeats - 1) * len(runnable)) as bar:
                for p in range(1, cfg.latency.repeats):  # timings only: answers and scores are the first pass's
                    bar.set_postfix_str(f"pass {p + 1}/{cfg.latency.repeats}")
                    for bi, chunk in enumerate(timed):
                        timer.time_batch([r for _, r in chunk], p, bi)
                        bar.update(len(chunk))
        else:
            progress.skip("repeats")
        paired = run_paired(cfg, engine, all_runnable, progress)  # latency.paired: A/B alternating, same batches
        if device_lock is not None:
            device_lock.end_of_measurement()
    finally:
        samples_log.close()
        if cache is not None:
            cache.close()
        engine_info = engine.describe()
        if pass1_stats is None:  # generation did not finish: what the engine gathered so far
            pass1_stats = engine.technique_stats() if hasattr(engine, "technique_stats") else {}
        # this attempt's statistics plus the replayed batches' (whole after a resume; partial where they cannot be)
        technique_stats = merge_replayed(pass1_stats, replayed_stats if cache is not None else [],
                                         sum(1 for r in records if not r["cached"] and r["output_tokens"] is not None),
                                         generated_stats)
        engine.close()
    _check_sere_engaged(run_dir, state, technique_stats)

    with progress.phase("finish", unit="step"):  # aggregate, write summary.json, log to W&B
        wall_s = time.perf_counter() - wall0
        summary = {
            "run": {**run_block(engine_info, model_info, cfg.seed, started), "end_time": utc_now(),
                    "wall_time_s": round(wall_s, 3), "run_dir": str(run_dir), "sweep": sweep_info(),
                    "attempt": state["attempt"]},
            "config": config,
            "metrics": aggregate(records),
            "latency": run_latency(records, gen_s, timer, cfg.latency, cfg.seed),
            **technique_stats,
        }
        summary["run"]["scoring"] = scorer.describe()  # which encoders scored, and whether their weights are random
        if cfg.visionzip.keep < 1.0:
            summary["visionzip"] = visionzip_summary(cfg.visionzip, records)
        if cache is not None:
            summary["cache"] = cache.stats()
        if load_info is not None:
            summary["load"] = load_info
        if device_lock is not None:
            summary["latency"].setdefault("protocol", {})["device"] = device_lock.info()
        if paired is not None:
            summary["latency"]["paired"], summary["comparisons"] = paired.summary(seed=cfg.seed)
            with open(run_dir / "paired_timings.jsonl", "w", encoding="utf-8") as f:
                for sample in paired.samples():
                    f.write(json.dumps(sample) + "\n")
        if timer.samples:  # every timing taken, one line per request and pass (excluded ones flagged)
            with open(run_dir / "timings.jsonl", "w", encoding="utf-8") as f:
                for sample in timer.samples:
                    f.write(json.dumps(sample) + "\n")
        summary["run"]["phase_s"] = dict(progress.times)  # seconds per phase (not "finish", still running)
        summary["warnings"] = run_warnings(summary)  # what a reader must know (random weights, unparsable, …)
        for warning in summary["warnings"]:  # INFO: the console shows them once, in the end-of-run summary
            log.info("warning: %s", warning)
        write_summary(run_dir / "summary.json", summary)
        nothing_scored = all_data_errors(records)
        if nothing_scored:  # summary.json stays for inspection; the run is failed, exit 2 (a sweep: that job)
            mark_failed(run_dir, state, nothing_scored)
            raise NothingScored(f"{nothing_scored}; summary.json and samples.jsonl are in {run_dir}")
        mark_finished(run_dir, state)
        log.info("%s written", run_dir / "summary.json")
        if live is not None:  # a kill from here on is redone by the rerun (run_state.json wandb.logged false)
            wandb_dir = live.finish(config, summary, records, run_dir)
            if wandb_dir:
                summary["run"]["wandb_dir"] = wandb_dir
                write_summary(run_dir / "summary.json", summary)
            mark_wandb_logged(run_dir, state, wandb_dir)
    return summary
