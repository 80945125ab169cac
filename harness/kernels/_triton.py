"""Where a Triton kernel of this package can run: one check instead of a copy in every kernel module.

Why a module of its own: every kernel dispatches the same way — the Triton kernel on a CUDA tensor, the
Triton interpreter on a CPU tensor when ``TRITON_INTERPRET=1`` was set before ``triton`` was imported (how CI
tests kernels on machines without a GPU), and the kernel's torch reference everywhere else.
Imports: torch only (triton is imported by the kernel modules, never here).
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
import textwrap

import torch

__all__ = ["interpreting", "source_text_key", "triton_runs"]


def interpreting() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET`` set to a non-zero value)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs(device: torch.device | str, kernel: object | None = None) -> bool:
    """Can a Triton kernel run on tensors of ``device``? CUDA: yes. CPU: only in the interpreter, and then
    only if ``kernel`` (a ``@triton.jit`` function, when given) was built as an interpreted function — a
    kernel module imported before ``TRITON_INTERPRET`` was set holds compiled kernels, which need a GPU."""
    if torch.device(device).type == "cuda":
        return True
    if not interpreting():
        return False
    return kernel is None or type(kernel).__name__ == "InterpretedFunction"


def source_text_key(*kernels: object) -> str:
    """One hash of the source text of every Triton function defined in the modules that define ``kernels`` (by
    name, dedented): which kernel code a timing ran, recorded beside it. Why the text and not Triton's
    ``cache_key``: that key includes each function's starting line number, so a docstring edit above a kernel
    changed it and a timing no longer paired with unchanged code (session 23). Over-inclusive by design: a
    helper of those modules that no kernel calls counts too. Works compiled and interpreted alike."""
    modules = dict.fromkeys(sys.modules[k.fn.__module__] for k in kernels)
    parts = []
    for module in modules:
        for name, obj in sorted(vars(module).items()):
            fn = getattr(obj, "fn", None)
            if type(obj).__name__ in ("JITFunction", "InterpretedFunction") and getattr(fn, "__module__", None) \
                    == module.__name__:
                parts.append(f"{module.__name__}.{name}\n{textwrap.dedent(inspect.getsource(fn))}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
