"""The latency measurement protocol (``latency.*`` keys, docs/latency.md), engine-agnostic.

One latency pass is not a measurement: a shape the warm-up did not cover pays compilation or graph capture
inside a timed batch, and one pass has no spread. The run (``harness/run/experiment.py``) hands its batches to
:class:`harness.latency.runner.TimedBatches`, which

* warms up one batch per shape key (:mod:`harness.latency.shapes`: batch size, prompt-length bucket, technique
  state) before anything is timed,
* verifies every timed batch (:mod:`harness.latency.watch`: the engine's graph-capture counter, torch.compile's
  counters, a first-seen shape key) and re-times or excludes one that compiled, recording what it did,
* re-times the same requests ``latency.repeats`` times (answers from the first pass only),

and :mod:`harness.latency.stats` turns the timings into ``summary.json`` ``latency`` (mean, p50/p90/p99, a
bootstrap interval of the mean, the pass-to-pass coefficient of variation). :mod:`harness.latency.device_lock`
makes jobs on one device take turns (``latency.sequential``) and notices when they did not;
:mod:`harness.latency.launcher` warns before a sweep whose launcher runs jobs side by side.

Nothing here imports torch, numpy or scipy at module level.
"""
