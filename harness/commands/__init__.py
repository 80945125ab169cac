"""The ``python -m`` tools that are not the run: SERE calibration and protection, offload trace recording,
the disaggregated vLLM prefill/decode check, the embedded model's evaluation and checkpoint adoption. They share
the run's parts (config, datasets, engines), never its loop.
"""
