"""The report: reads result files only (``rows``), compares runs (``build``) and writes Markdown, plots, a status
line and a W&B report. ``python -m harness.report`` runs it.
"""

from harness import _moved as _moved


def __getattr__(name: str):  # the old module harness.report (before issue 24's folder moves): its names, for one release
    return _moved.forward_attribute(__name__, name, ('__main__', 'build', 'deltas', 'markdown', 'panels', 'plots', 'rows', 'status', 'wandb_report'))
