"""The vLLM integration: the offline engine, load/serving modes and the plugin every vLLM process loads.

Nothing here imports vLLM at import time (the main venv has no vLLM); each module has one job:

================ ==========================================================================================
``plugin``       the ``vllm.general_plugins`` entry point (``register``): what it installs into vLLM
``settings``     the ``HARNESS_*`` environment-variable contract between the harness and vLLM's processes
``routing``      what SERE's and ``moe.top_k``'s routing functions share (stock top-k, decode rows, stats)
``sere``         SERE's per-layer ``custom_routing_function``, artifacts and statistics
``topk``         ``moe.top_k``'s per-layer ``custom_routing_function`` and statistics
``visionzip``    the VisionZip processor/model subclasses of vLLM's Qwen3-VL-MoE
``techniques``   run config → plugin settings (SERE artifacts, VisionZip, ``moe.top_k``) and their env
``engine``       ``VLLMEngine``: offline generation through ``vllm.LLM``
``load``         load mode in process (``AsyncLLM``) at ``vllm bench serve``'s arrival times
``disagg``       prefill/decode disaggregation through a KV connector, compared with the colocated run
================ ==========================================================================================

docs/vllm.md describes the whole.
"""
