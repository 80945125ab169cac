"""Old module paths keep working for one release after the folder moves of issue 24 (0.x → the layout of
``shared/notes/layout.md``); the README's "What moved" table lists them.

Why a finder rather than a shim file per old path: shims would put the old flat names back into the folder
listing that the moves cleaned up. Instead :class:`MovedFinder` (installed by ``harness/__init__.py``) answers
only for the old names below, which no longer exist as files:

- ``import harness.engines.hf_sere`` gives the module's new home, ``harness.engines.hf.sere``, with a
  ``DeprecationWarning`` (the same module object: patching it patches the new one);
- ``python -m harness.techniques.offload_trace …`` prints where the command moved and runs it there.

Old module names that are now packages (``harness.run``, ``harness.config`` …) forward their old attributes
through the package's ``__getattr__`` (:func:`forward_attribute`), also with a ``DeprecationWarning``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module → its new home (modules whose old name is free)
MOVED: dict[str, str] = {
    "harness.models.v4_init": "harness.models.prior_init",  # session 15: it resolves every earlier checkpoint
    "harness.cache": "harness.run.cache",
    "harness.compat": "harness.engines.compat",
    "harness.datasets.synthetic_bundle": "harness.datasets.synthetic.bundle",
    "harness.datasets.synthetic_ocr_cc": "harness.datasets.synthetic.ocr_cc",
    "harness.datasets.synthetic_tasks": "harness.datasets.synthetic.tasks",
    "harness.engines.hf_attention_decode": "harness.engines.hf.attention_decode",
    "harness.engines.hf_attention_lse": "harness.engines.hf.attention_lse",
    "harness.engines.hf_compile": "harness.engines.hf.compiled",
    "harness.engines.hf_decode_forward": "harness.engines.hf.decode_forward",
    "harness.engines.hf_direct": "harness.engines.hf.direct",
    "harness.engines.hf_experts": "harness.engines.hf.experts",
    "harness.engines.hf_graphs": "harness.engines.hf.graphs",
    "harness.engines.hf_router": "harness.engines.hf.router",
    "harness.engines.hf_routing": "harness.engines.hf.routing",
    "harness.engines.hf_sere": "harness.engines.hf.sere",
    "harness.engines.hf_stop": "harness.engines.hf.stop",
    "harness.engines.hf_topk": "harness.engines.hf.topk",
    "harness.engines.hf_visionzip": "harness.engines.hf.visionzip",
    "harness.engines.vllm.disagg": "harness.commands.vllm_disagg",
    "harness.envinfo": "harness.results.envinfo",
    "harness.logs": "harness.run.logs",
    "harness.models.adopt_checkpoint": "harness.commands.adopt_checkpoint",
    "harness.models.eval_tiny": "harness.commands.eval_tiny",
    "harness.offload": "harness.techniques.offload",
    "harness.offload.experts": "harness.engines.hf.offload",
    "harness.outcome": "harness.run.outcome",
    "harness.paths": "harness.config.paths",
    "harness.progress": "harness.run.progress",
    "harness.report_markdown": "harness.report.markdown",
    "harness.report_plots": "harness.report.plots",
    "harness.report_rows": "harness.report.rows",
    "harness.report_status": "harness.report.status",
    "harness.report_wandb": "harness.report.wandb_report",
    "harness.run_state": "harness.run.state",
    "harness.scoring": "harness.metrics.scoring",
    "harness.techniques.offload_trace": "harness.commands.offload_trace",
    "harness.techniques.sere_calibration": "harness.techniques.sere.calibration",
    "harness.techniques.sere_graphs": "harness.techniques.sere.graphs",
    "harness.techniques.sere_protection": "harness.techniques.sere.protection",
    "harness.techniques.visionzip_bundle": "harness.techniques.visionzip.bundle",
    "harness.tracking": "harness.results.tracking",
    "harness.validate": "harness.run.validate",
    "harness.validate_checks": "harness.config.checks",
    "harness.validate_latency": "harness.run.rules_latency",
    "harness.validate_offload": "harness.run.rules_offload",
}
#: command lines that left their module: the old ``python -m`` path runs the new command
MOVED_COMMANDS: dict[str, str] = {
    "harness.techniques.sere_calibration": "harness.commands.sere_calibrate",
    "harness.techniques.sere_protection": "harness.commands.sere_protect",
    "harness.datasets.synthetic_tasks": "harness.datasets.synthetic.bundle",
}
#: old module → new module, for old modules whose name is now a package (attributes forwarded by the package)
BECAME_PACKAGE: dict[str, str] = {
    "harness.config": "harness.config.schema",
    "harness.datasets.synthetic": "harness.datasets.synthetic.rag_igbench",
    "harness.engines.hf": "harness.engines.hf.engine",
    "harness.report": "harness.report.build",
    "harness.results": "harness.results.schema",
    "harness.run": "harness.run.experiment",
    "harness.techniques.sere": "harness.techniques.sere.reroute",
    "harness.techniques.visionzip": "harness.techniques.visionzip.pruning",
}
_PACKAGE_MOVES = {"harness.offload": "harness.techniques.offload"}


def new_name(old: str) -> str | None:
    """The new dotted name of an old module, or None when ``old`` did not move."""
    if old in MOVED:
        return MOVED[old]
    for pkg, new_pkg in _PACKAGE_MOVES.items():
        if old.startswith(pkg + "."):
            return new_pkg + old[len(pkg):]
    return None


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} moved to {new}; the old name goes away in the next release",
                  DeprecationWarning, stacklevel=3)


class _Forward(importlib.abc.Loader):
    """Loads an old name as its new module (import) or runs the new command (``python -m``, through runpy,
    which asks the loader for code)."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        _warn(self.old, self.new)
        # the import system hands back whatever sys.modules holds under the name once this returns
        sys.modules[self.old] = importlib.import_module(self.new)

    def get_code(self, fullname):
        command = MOVED_COMMANDS.get(self.old, self.new)
        src = ("import runpy, sys\n"
               f"print('note: python -m {self.old} moved to python -m {command}; "
               "this forward goes away in the next release', file=sys.stderr)\n"
               f"runpy.run_module({command!r}, run_name='__main__', alter_sys=True)\n")
        return compile(src, f"<moved {self.old}>", "exec")

    def is_package(self, fullname) -> bool:
        return False


class MovedFinder(importlib.abc.MetaPathFinder):
    """Answers only for the old names of moved modules; everything else goes to the normal finders."""

    def find_spec(self, fullname, path=None, target=None):
        new = new_name(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Forward(fullname, new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())


def forward_attribute(package: str, name: str, children: tuple[str, ...] = ()):
    """``harness.run.run`` (an attribute of the old module ``harness/run.py``) → ``harness.run.experiment.run``.

    For a package's module-level ``__getattr__``: raises AttributeError for dunder names and for the package's
    own submodules (so ``from harness.run import cache`` imports the submodule as usual).
    """
    if name.startswith("__") or name in children:
        raise AttributeError(name)
    new = BECAME_PACKAGE[package]
    module = importlib.import_module(new)
    try:
        value = getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    _warn(f"{package}.{name}", f"{new}.{name}")
    return value
