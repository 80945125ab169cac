"""VisionZip (prefill): keep the most-attended visual tokens under one budget shared by a request's images, each
kept token at its original position. ``pruning`` is the algorithm; ``bundle`` packs the pruned inputs an
engine consumes; ``stats`` holds what it did to each request and the per-source keep rate over a run.
"""

from harness import _moved as _moved


def __getattr__(name: str):  # the old module harness.techniques.visionzip (before issue 24's folder moves): its names, for one release
    return _moved.forward_attribute(__name__, name, ('bundle', 'pruning'))
