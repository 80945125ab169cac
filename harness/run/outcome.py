"""What a user reads about a run: the prompt and parsed answer in each ``samples.jsonl`` line, the warnings of
``summary.json`` (``warnings``) and the short console summary ``python -m harness`` ends with.

Why a module of its own: the same warnings ("all 12 answers unparsable", "random-init weights") must reach the
console, the run's log file and ``summary.json`` alike, worded once. Only the standard library is imported.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

from harness.metrics.rag_igbench_answer import parse_answer

# quality keys shown on the console, per benchmark (the first present of each group)
CONSOLE_METRICS = (("comprehensive", "rouge1", "edit_score", "kendall", "clip_score", "alignment"),
                   ("ocrbench_score",), ("mcq_accuracy",))
RANDOM_SCORER_METRICS = {"clip": ("clip_score",), "embed": ("alignment",)}


def unmeaningful_metrics(scoring: Any) -> set[str]:
    """The quality metrics a random-init scorer feeds in this run (``summary.json`` ``run.scoring``
    ``clip_weights`` / ``embed_weights`` == ``"random-init"``), ``comprehensive`` with them (it averages them in).

    Why keyed on the recorded weights, not on the scorer's name: a trained or reference scorer (a local directory
    whose ``harness_model.json`` says so, or pretrained weights) is recorded with another label, and its metrics
    head the console again by themselves (issue 28 item 4)."""
    if not isinstance(scoring, Mapping):
        return set()
    out = {m for kind, metrics in RANDOM_SCORER_METRICS.items() if scoring.get(f"{kind}_weights") == "random-init"
           for m in metrics}
    return out | {"comprehensive"} if out else out


def prompt_text(content: list[dict[str, Any]]) -> str:
    """The request's text as the model reads it, images as ``<image k>`` markers (k = 1-based request order)."""
    parts = []
    for part in content:
        if part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        elif part.get("type") == "image":
            parts.append(f"<image {int(part.get('index', 0)) + 1}>")
    return "".join(parts)


def prompt_record(sample: Any) -> dict[str, Any]:
    """``samples.jsonl`` ``prompt`` (the full text, before the engine's chat template), ``prompt_sha256``
    (a stable reference: equal prompts have equal hashes across runs and engines) and ``images`` (each image's
    file, or its key in the data file when it came as bytes; W&B's samples table shows thumbnails of the files)."""
    text = prompt_text(sample.content or [])
    images = [str(img.path) if getattr(img, "path", None) is not None else str(getattr(img, "key", "") or "")
              for img in getattr(sample, "images", None) or []]
    return {"prompt": text, "prompt_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "images": images}


def parsed_answer(sample: Any, answer: str, scores: Mapping[str, Any]) -> Any:
    """What the scorer read out of the raw answer: RAG-IGBench's ``answer`` field of the model's JSON (None when
    unparsable), CCBench's extracted choice, OCRBench's whole answer (it scores substrings of it)."""
    if not answer:
        return None
    if sample.task == "rag_igbench":
        return parse_answer(answer)
    if sample.task == "mcq":
        return scores.get("pred")
    return answer


def _n(x: Any) -> int:
    return int(x) if isinstance(x, (int, float)) else 0


def _has_metric(metrics: Mapping[str, Any], key: str) -> bool:
    """``key`` has a value in ``metrics`` or in one of its ``per_task`` blocks."""
    if metrics.get(key) is not None:
        return True
    return any(isinstance(b, Mapping) and b.get(key) is not None for b in (metrics.get("per_task") or {}).values())


def run_warnings(summary: Mapping[str, Any]) -> list[str]:
    """The caveats of one run's numbers, one sentence each (``summary.json`` ``warnings``)."""
    run, metrics, lat = (summary.get(k) or {} for k in ("run", "metrics", "latency"))
    out: list[str] = []
    if run.get("weights") == "random-init":
        name = (run.get("model") or {}).get("name") or "model"
        out.append(f"random-init model weights ({name}): the quality numbers mean nothing, only latency does")
    elif run.get("weights") == "trained-synthetic":
        out.append("trained-synthetic model weights (the embedded model, docs/embedded_model.md): quality numbers show "
                   "what a technique costs this machinery-level model, not a real model's quality")
    scoring = run.get("scoring") or {}
    # only scorers whose metrics this run has (OCRBench and CCBench use neither CLIP nor the embedder)
    kinds = [kind for kind in ("clip", "embed") if scoring.get(f"{kind}_weights") == "random-init"
             and any(_has_metric(metrics, m) for m in RANDOM_SCORER_METRICS[kind])]
    if kinds:
        hit = [m for kind in kinds for m in RANDOM_SCORER_METRICS[kind]]
        names = ", ".join(f"{kind} {scoring.get(kind + '_model')}" for kind in kinds)
        out.append(f"random-init scorers ({names}): "
                   f"{', '.join(hit)}{' and comprehensive' if _has_metric(metrics, 'comprehensive') else ''} "
                   "mean nothing")
    n = _n(metrics.get("n_samples"))
    blocks = [metrics, *(metrics.get("per_task") or {}).values()] if metrics.get("per_task") else [metrics]
    for block in blocks:
        for key, what in (("format_invalid", "answers unparsable (format_invalid)"),
                          ("hallucinated_image", "answers citing an image outside the candidates (hallucinated_image)"),
                          ("unparsed", "answers with no recognisable choice (unparsed)")):
            bad = _n(block.get(key))
            total = _n(block.get("n_samples") or block.get("n_rows") or n)
            if bad:
                share = f"all {bad}" if bad >= total else f"{bad} of {total}"
                out.append(f"{share} {what}: see scores.reason / the answers in samples.jsonl")
    errors = _n(metrics.get("errors"))
    if errors:
        out.append(f"{errors} of {n} samples failed (scored 0): see error in samples.jsonl")
    data_errors = metrics.get("data_errors")
    if isinstance(data_errors, Mapping) and _n(data_errors.get("total", sum(
            _n(v) for v in data_errors.values() if not isinstance(v, Mapping)))):
        out.append(f"data errors in the dataset: {dict(data_errors)}")
    if lat.get("partial"):
        out.append(f"latency partial: {_n(lat.get('n_measured'))} requests timed, {_n(lat.get('n_cached'))} "
                   "replayed from the generation cache (no timings)")
    out.extend(latency_warnings(lat))
    load = summary.get("load") or {}
    sent, distinct = _n(load.get("num_requests")), _n(load.get("distinct_requests"))
    if distinct and sent > distinct:
        out.append(f"load: {sent} requests cycle over {distinct} distinct prompts: a repeated prompt's prefill can "
                   "come from vLLM's prefix cache (on by default), so its TTFT is a cache hit's; make the dataset as "
                   "large as the load (dataset.num_requests for synthetic_load) for prefills that are all computed")
    for tech in ("sere", "moe"):
        block = summary.get(tech) or {}
        if block.get("partial"):
            out.append(f"{tech} statistics cover the {_n(block.get('requests_covered'))} requests generated in "
                       f"this attempt, not the {_n(block.get('requests_replayed'))} replayed")
    return out


LATENCY_NAMES = {"ttft_ms": "TTFT", "tpot_ms": "TPOT", "itl_ms": "ITL", "e2e_ms": "E2E"}


def latency_warnings(lat: Mapping[str, Any]) -> list[str]:
    """The measurement protocol's caveats (harness/latency/): a spread too large for a comparison, timed batches
    excluded or kept although they compiled, another job measuring on the same device."""
    out: list[str] = []
    max_cv = lat.get("max_cv")
    noisy = [(LATENCY_NAMES.get(m, m), (lat.get(m) or {}).get("cv"), _n((lat.get(m) or {}).get("passes")))
             for m in lat.get("noisy") or []]
    noisy = [(name, cv, n) for name, cv, n in noisy if isinstance(cv, (int, float))]
    if noisy and isinstance(max_cv, (int, float)):
        out.append("latency spread too large: " + ", ".join(f"{name} {cv:.0%}" for name, cv, _ in noisy)
                   + f" pass-to-pass coefficient of variation over {noisy[0][2]} passes (> latency.max_cv="
                   f"{max_cv:g}): a difference smaller than that is noise")
    protocol = lat.get("protocol") or {}
    excluded, kept = _n(protocol.get("batches_excluded")), _n(protocol.get("batches_kept_dirty"))
    if excluded:
        out.append(f"latency: {excluded} timed batches compiled, captured a graph or ran an unwarmed shape even "
                   f"after re-timing and were excluded ({_n(protocol.get('samples_excluded'))} request timings): "
                   "see latency.protocol.events")
    if kept:
        out.append(f"latency: {kept} timed batches compiled, captured a graph or ran an unwarmed shape and were kept "
                   "(latency.on_compile=keep): their timings include that cost")
    states, needed = protocol.get("graph_states"), protocol.get("shapes_needing_states")
    if isinstance(states, int) and isinstance(needed, int) and needed > states:
        out.append(f"latency: the run's batches have {needed} (batch size, prompt length) shapes but the HF decoder "
                   f"keeps {states} captured graphs (engine.graph_states): graphs are evicted and recaptured in "
                   f"turn, so warm-up cannot cover them; raise engine.graph_states to {needed} if memory allows")
    device = protocol.get("device") or {}
    if device.get("concurrent"):
        out.append(f"another harness job was measuring on the same device ({device.get('key')}) during this run: its "
                   "latency figures are disturbed (latency.sequential=true makes jobs take turns)")
    return out


def _fmt_ms(d: Any) -> str:
    p50 = d.get("p50") if isinstance(d, Mapping) else None
    return "n/a" if p50 is None else f"{p50:.1f} ms" if p50 < 100 else f"{p50:.0f} ms"


def _spread(lat: Mapping[str, Any]) -> str:
    """`` · 3 passes, TPOT mean 41.2 ms [40.1, 42.3] CV 2%`` when the run repeated its timings."""
    if _n(lat.get("repeats")) <= 1:
        return ""
    block = lat.get("tpot_ms") or {}
    if not isinstance(block.get("mean"), (int, float)):
        block, name = lat.get("ttft_ms") or {}, "TTFT"
    else:
        name = "TPOT"
    ci, cv = block.get("ci"), block.get("cv")
    text = f" · {_n(lat.get('repeats'))} passes"
    if isinstance(block.get("mean"), (int, float)):
        text += f", {name} mean {block['mean']:.1f} ms"
        if ci:
            text += f" [{ci[0]:.1f}, {ci[1]:.1f}]"
        if isinstance(cv, (int, float)):
            text += f" CV {cv:.0%}"
    return text


def console_summary(summary: Mapping[str, Any], run_dir: str | None = None) -> str:
    """A few lines for the end of ``python -m harness``: where, what, key metrics, latency, warnings."""
    run, metrics, lat = (summary.get(k) or {} for k in ("run", "metrics", "latency"))
    model = (run.get("model") or {}).get("name") or "?"
    # the batch is part of the setup a reader compares: SERE re-routes among the experts its decode batch chose,
    # so its quality moves with the batch (engine=hf batches 4 by default, engine=vllm up to 64)
    batch = ((summary.get("config") or {}).get("engine") or {}).get("batch_size")
    lines = [f"run      {run_dir or run.get('run_dir')}",
             f"setup    {model} ({run.get('weights') or '?'}) · {run.get('engine')} {run.get('engine_version') or ''}"
             f" · {run.get('dtype')} · {run.get('device_name')}" + (f" · batch {batch}" if batch else "")]
    quality = []
    hidden = unmeaningful_metrics(run.get("scoring"))
    for group in CONSOLE_METRICS:
        shown = [k for k in group if isinstance(metrics.get(k), (int, float)) and k not in hidden]
        for k in shown[:4]:
            v = metrics[k]
            quality.append(f"{k} {v:.1%}" if k == "mcq_accuracy" else f"{k} {v:.0f}" if k == "ocrbench_score"
                           else f"{k} {v:.3f}")
    n, scored = metrics.get("n_samples"), metrics.get("n_scored")
    count = f"{n} samples" + (f", {scored} scored" if scored is not None else "")
    not_shown = [k for group in CONSOLE_METRICS for k in group
                 if k in hidden and isinstance(metrics.get(k), (int, float))]
    lines.append(f"quality  {' · '.join(quality) or 'n/a'}  ({count})"
                 + (f"; {', '.join(not_shown)} not shown: random-init scorers (in summary.json)" if not_shown else ""))
    lines.append(f"latency  TTFT p50 {_fmt_ms(lat.get('ttft_ms'))} · TPOT p50 {_fmt_ms(lat.get('tpot_ms'))} · "
                 f"E2E p50 {_fmt_ms(lat.get('e2e_ms'))}  ({_n(lat.get('n_measured'))} timed"
                 + (f", {_n(lat.get('n_cached'))} replayed" if lat.get("n_cached") else "") + ")"
                 + _spread(lat))
    for tech, keys in (("visionzip", ("keep_rate",)), ("sere", ("expert_union_before", "expert_union_after"))):
        block = summary.get(tech)
        if isinstance(block, Mapping) and any(block.get(k) is not None for k in keys):
            lines.append(f"{tech:<9}{' ' if len(tech) >= 9 else ''}" + " · ".join(f"{k} {block[k]:.3f}" for k in keys
                                                   if isinstance(block.get(k), (int, float))))
    for w in summary.get("warnings") or run_warnings(summary):
        lines.append(f"warning  {w}")
    files = "summary.json, samples.jsonl, config.yaml"
    lines.append(f"files    {files}" + (f"; W&B {run['wandb_dir']}" if run.get("wandb_dir") else ""))
    return "\n".join(lines)
