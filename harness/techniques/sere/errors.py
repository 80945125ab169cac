"""SERE's exceptions, in a module without torch: the CLI names them in the refusals it turns into one line (exit
code 2), and a refused configuration should not pay torch's import (~6 s of CPU) before it is refused."""

from __future__ import annotations


class SereNotEngaged(RuntimeError):
    """A run with SERE on whose routing statistics show that SERE did not act on its decode tokens."""
