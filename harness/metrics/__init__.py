"""Scoring: pure functions from a model's outputs and the references to numbers, one module per benchmark.

* :mod:`harness.metrics.rag_igbench` — Rouge-1, image edit / Kendall scores, CLIP and alignment, per sample
  (``score_sample``) and over a run (``aggregate``); its neural encoders live in
  :mod:`harness.metrics.encoders` and load lazily; reading a model's answer (its JSON repaired, the markdown's
  image numbers, text and image contexts) is :mod:`harness.metrics.rag_igbench_answer`; the words Rouge-1 counts
  (jieba, the stopword lists of ``scoring.stopwords``) are :mod:`harness.metrics.rag_igbench_words`.
* :mod:`harness.metrics.ocrbench` — OCRBench v1 substring scoring and the 1000-point total.
* :mod:`harness.metrics.mcq` — rule-based choice extraction and circular accuracy (CCBench / MMBench).
* :mod:`harness.metrics.latency` — TTFT / TPOT / ITL / E2E summaries.

Nothing is imported here, so importing one scorer never pulls in another's dependencies.
"""
