"""The run: one Hydra-configured experiment end to end (``experiment``) and the parts it is made of — the
validation rules checked before any model loads (``validate``, ``rules_cross``, ``rules_model``, ``rules_offload``,
``rules_latency``), crash-safe state and the generation cache (``state``, ``cache``), progress, logs and the outcome
a run ends with.
"""

from harness import _moved as _moved


def __getattr__(name: str):  # the old module harness.run (before issue 24's folder moves): its names, for one release
    return _moved.forward_attribute(__name__, name, ('cache', 'experiment', 'logs', 'outcome', 'progress', 'rules_cross', 'rules_latency', 'rules_model', 'rules_offload', 'state', 'summary_blocks', 'validate'))
