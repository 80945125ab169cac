"""What every GPU benchmark script's command line shares: ``--smoke`` / ``--out`` and the device decision.

A script runs on CUDA, or with ``--smoke`` on CPU (the same code path at tiny shapes, to test the script itself);
without either there is nothing meaningful to time, so it says so and exits 0. Imports torch only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def add_device_args(ap: argparse.ArgumentParser, smoke_help: str = "CPU, tiny shapes: the code path only") -> None:
    ap.add_argument("--smoke", action="store_true", help=smoke_help)
    ap.add_argument("--out", type=Path, default=None)


def use_cuda(args: argparse.Namespace) -> bool | None:
    """True on CUDA, False for a ``--smoke`` run, None (after saying why) when there is nothing to run."""
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: use --smoke for the CPU code path")
        return None
    return cuda
