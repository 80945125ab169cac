"""Shared test set-up.

Triton kernels are tested on CPU through Triton's interpreter, which must be switched on before
``triton`` is first imported, hence here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
