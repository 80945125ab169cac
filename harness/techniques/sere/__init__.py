"""SERE (decode): re-route each token's secondary experts to the most similar expert already active in the batch.
``reroute`` is the algorithm (plain torch, the reference every engine hook and kernel is tested against);
``calibration`` builds the expert-similarity matrices it needs, ``protection`` the per-layer protected-expert
mask, ``graphs`` the batch statistics under CUDA graphs.
"""

from harness import _moved as _moved


def __getattr__(name: str):  # the old module harness.techniques.sere (before issue 24's folder moves): its names, for one release
    return _moved.forward_attribute(__name__, name, ('calibration', 'graphs', 'protection', 'reroute', 'setup'))
