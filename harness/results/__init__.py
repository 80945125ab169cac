"""What a run leaves behind: the ``summary.json`` it writes (``schema``), the environment it records (``envinfo``:
engine, versions, hardware) and the W&B logging (``tracking``). Report and run both read these; they import neither.
"""

from harness import _moved as _moved


def __getattr__(name: str):  # the old module harness.results (before issue 24's folder moves): its names, for one release
    return _moved.forward_attribute(__name__, name, ('envinfo', 'schema', 'tracking'))
