"""Configuration: the dataclasses Hydra types the YAML with (``schema``), where the configs live (``paths``),
the validation vocabulary every rule speaks (``checks``). The bottom floor: it imports nothing else of the package.
"""

from harness import _moved as _moved


def __getattr__(name: str):  # the old module harness.config (before issue 24's folder moves): its names, for one release
    return _moved.forward_attribute(__name__, name, ('access', 'checks', 'paths', 'schema'))
