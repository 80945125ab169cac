"""The Hugging Face transformers engine: ``engine`` (HFEngine: load, batch, generate, time) and the hooks that put
the techniques and the decode kernels into a transformers model — routing (the shared MoE routing hook), sere,
topk, visionzip, offload, the CUDA-graph and compiled decode paths (decode_path: which one a run takes), the
attention and router kernels' wiring.
"""

from harness import _moved as _moved


def __getattr__(name: str):  # the old module harness.engines.hf (before issue 24's folder moves): its names, for one release
    return _moved.forward_attribute(__name__, name, ('attention_decode', 'attention_lse', 'compiled', 'decode_forward', 'decode_path', 'direct', 'engine', 'experts', 'graph_counters', 'graphs', 'offload', 'router', 'routing', 'sere', 'stop', 'topk', 'visionzip'))
