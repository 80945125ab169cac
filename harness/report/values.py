"""One rule for reading a number out of a ``summary.json`` for the report: a finite float, or None (absent, not a
number, NaN or infinite), so that a malformed value becomes "n/a" in a cell instead of an exception."""

from __future__ import annotations

import math
from typing import Any


def finite(x: Any) -> float | None:
    """``x`` as a finite float, else None."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None
