"""moe-vlm-harness: measure what inference optimisations of MoE / vision-language models buy and cost.

Only the standard library is imported here so that ``import harness.kernels.x`` on a GPU machine
pulls in nothing beyond torch/triton.
"""

__version__ = "0.1.0"

from harness import _moved

_moved.install()  # old module paths (before the folder moves of issue 24) keep importing for one release
