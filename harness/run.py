"""One experiment, end to end: dataset → prompts → engine → answers → scores → result files → W&B.

Read top to bottom, this is the whole path a number takes. Nothing here is engine- or dataset-specific:
loaders, engines and scorers come from their registries.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from harness.results import SamplesLog, run_block, utc_now, write_json


class TechniqueNotAvailable(RuntimeError):
    """A technique was enabled in the config but is not implemented for this engine yet."""


def check_techniques(cfg: Any) -> None:
    """Refuse, loudly, techniques that would otherwise be silently ignored."""
    if cfg.visionzip.keep < 1.0 and cfg.engine.name != "hf":
        raise TechniqueNotAvailable(
            f"visionzip.keep={cfg.visionzip.keep}: VisionZip is not available yet in engine "
            f"{cfg.engine.name!r} (issue 5). Use visionzip.keep=1.0."
        )
    if cfg.sere.k is not None and cfg.engine.name != "hf":
        raise TechniqueNotAvailable(
            f"sere.k={cfg.sere.k}: SERE is not available yet in engine {cfg.engine.name!r} (issue 6). "
            "Use sere.k=null."
        )


def visionzip_summary(vz_cfg: Any, records: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary.json`` ``visionzip``: tokens in/kept, per-image keep-rate distribution, per-source keep rate
    (the OCRBench+CCBench budget competition) and the time spent on importance."""
    from harness.engines.hf_visionzip import keep_rate_by_source
    from harness.metrics.latency import summarize

    per_request = []
    for r in records:
        v = r.get("visionzip")
        if not v:
            continue
        sources = r["meta"].get("image_sources") or [r["meta"].get("source") or r["dataset"]] * len(
            v["tokens_per_image"])
        per_request.append((sources, v["tokens_per_image"], v["kept_per_image"]))
    tokens_in = sum(sum(t) for _, t, _ in per_request)
    kept = sum(sum(k) for _, _, k in per_request)
    image_rates = [k / t for _, ts, ks in per_request for t, k in zip(ts, ks) if t]
    return {
        "keep": vz_cfg.keep, "contextual": vz_cfg.contextual, "scope": vz_cfg.scope, "layer": vz_cfg.layer,
        "min_per_image": vz_cfg.min_per_image, "requests": len(per_request),
        "visual_tokens_in": tokens_in, "visual_tokens_kept": kept,
        "keep_rate": kept / tokens_in if tokens_in else None,
        "image_keep_rate": summarize(image_rates),
        "by_source": keep_rate_by_source(per_request),
        # each request carries its share of its batch's importance time: the sum is the run's total
        "importance_ms_total": sum(r["visionzip"]["importance_ms"] for r in records if r.get("visionzip")),
    }


def resolve_model(model_cfg: Any) -> tuple[str, dict[str, Any]]:
    """The checkpoint path to load and the ``run.model`` block (the embedded model is built on first use)."""
    if model_cfg.embedded:
        from harness.models.tiny import TinyModelSpec, ensure_tiny_model

        spec = TinyModelSpec(seed=model_cfg.seed)
        path = ensure_tiny_model(spec)
        return str(path), {"name": model_cfg.name, "path": str(path), "fingerprint": spec.fingerprint(),
                           "weights": "random-init"}
    if not model_cfg.path:
        raise ValueError(f"model {model_cfg.name!r}: model.path is not set")
    return model_cfg.path, {"name": model_cfg.name, "path": model_cfg.path, "weights": model_cfg.weights}


def run_experiment(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Run the configured experiment, write ``config.yaml``, ``samples.jsonl``, ``summary.json``."""
    from omegaconf import OmegaConf
    from tqdm.auto import tqdm

    from harness.datasets import load_samples
    from harness.engines import make_engine
    from harness.engines.base import Request
    from harness.metrics.latency import latency_summary
    from harness.scoring import Scorer, aggregate
    from harness.tracking import log_run

    check_techniques(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    config = OmegaConf.to_container(cfg, resolve=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(config), encoding="utf-8")

    samples = list(load_samples(cfg.dataset))
    if not samples:
        raise ValueError(f"dataset {cfg.dataset.name!r} produced no samples (check dataset.split / limit)")
    model_path, model_info = resolve_model(cfg.model)
    extra = ({"sere_cfg": cfg.sere, "visionzip_cfg": cfg.visionzip, "model_id": model_info["name"]}
             if cfg.engine.name == "hf" else {})
    engine = make_engine(cfg.engine.name, model_path, cfg.engine, cfg.generation,
                         trust_remote_code=cfg.model.trust_remote_code, **extra)

    scorer = Scorer(cfg.scoring)
    samples_log = SamplesLog(run_dir / "samples.jsonl")
    records: list[dict[str, Any]] = []
    wall0 = time.perf_counter()

    def record(sample, gen=None, error: str | None = None) -> None:
        error = error or (gen.error if gen else None)
        answer = gen.text if gen and not error else ""
        scores = scorer(sample, answer, error)
        rec = {
            "uid": sample.uid,
            "dataset": sample.dataset,
            "task": sample.task,
            "n_images": len(sample.images),
            "prompt_tokens": gen.prompt_tokens if gen else None,
            "visual_tokens": gen.visual_tokens if gen else None,
            "output_tokens": gen.output_tokens if gen else None,
            "answer": answer,
            "scores": scores,
            "ttft_ms": gen.ttft_ms if gen else None,
            "tpot_ms": gen.tpot_ms if gen else None,
            "e2e_ms": gen.e2e_ms if gen else None,
            "error": error,
            "visionzip": gen.extra.get("visionzip") if gen else None,
            "meta": sample.meta,
        }
        records.append(rec)
        samples_log.write(rec)

    try:
        runnable: list[tuple[Any, Request]] = []
        for sample in samples:
            if sample.error:
                record(sample, error=sample.error)
                continue
            try:
                runnable.append((sample, Request(sample.uid, sample.content, sample.load_images())))
            except Exception as e:  # noqa: BLE001 - a bad image costs its sample, never the run
                record(sample, error=f"{type(e).__name__}: {e}")
        bs = max(1, cfg.engine.batch_size)
        if runnable and hasattr(engine, "warmup"):
            for _ in range(cfg.engine.warmup):  # a full first batch, so batch-size-dependent set-up is paid
                engine.warmup([r for _, r in runnable[:bs]])
        gen0 = time.perf_counter()
        with tqdm(total=len(runnable), desc=f"{cfg.engine.name} · {cfg.dataset.name}", unit="sample") as bar:
            for i in range(0, len(runnable), bs):
                chunk = runnable[i : i + bs]
                for (sample, _), gen in zip(chunk, engine.generate_batch([r for _, r in chunk])):
                    record(sample, gen)
                bar.update(len(chunk))
        gen_s = time.perf_counter() - gen0
    finally:
        samples_log.close()
        engine_info = engine.describe()
        technique_stats = engine.technique_stats() if hasattr(engine, "technique_stats") else {}
        engine.close()

    wall_s = time.perf_counter() - wall0
    summary = {
        "run": {**run_block(engine_info, model_info, cfg.seed, started), "end_time": utc_now(),
                "wall_time_s": round(wall_s, 3), "run_dir": str(run_dir)},
        "config": config,
        "metrics": aggregate(records),
        "latency": latency_summary(records, duration_s=gen_s),
        **technique_stats,
    }
    if cfg.visionzip.keep < 1.0:
        summary["visionzip"] = visionzip_summary(cfg.visionzip, records)
    write_json(run_dir / "summary.json", summary)
    wandb_dir = log_run(cfg.wandb, config, summary, records, run_dir, name=run_dir.name)
    if wandb_dir:
        summary["run"]["wandb_dir"] = wandb_dir
        write_json(run_dir / "summary.json", summary)
    return summary
