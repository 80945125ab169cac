"""The package's import graph keeps the rules of ``shared/notes/layout.md`` (issue 24): no import circle and
no forbidden import.

How it reads the graph: every module under ``harness/`` is parsed with :mod:`ast` (nothing is imported, so
the test needs neither torch nor vLLM and runs in a second). Every ``import`` statement counts — at module
level, inside functions, under ``if`` or ``try`` — because a function-level import is still a dependency,
and hiding a circle inside a function is what the issue asks to stop. ``from x import y`` is an edge to
``x.y`` when ``y`` is a submodule, else to ``x``; relative imports are resolved against the importing
module's package. Not counted: the registries' lazy ``"module:attr"`` strings (``harness/engines``,
``harness/datasets``, ``harness/techniques/offload/policy``) — a registry names its entries by design — and the implicit
import of parent packages, and imports under a module-level ``if __name__ == "__main__":`` (they run only when
the file is executed as a script, i.e. as a different module, ``__main__``: an old ``python -m`` entry point
that forwards to the module its command moved to keeps working without importing it). Only edges inside the
package (``harness.*``) are graph edges.

Rooms and floors: each module belongs to the room of the target layout it lives in today (its folder, or
for a flat top-level module the room the layout moves it to), except the few modules that the layout moves
to another room wholesale (:data:`ROOM_OVERRIDES`: they are judged by the room they are headed for). The
rules of the note are :data:`FORBIDDEN` (source rooms, target rooms, the rule). Floors (:data:`FLOORS`) only
count "upward" edges (a lower floor importing a higher one) for the report; an upward edge fails the test
only when a rule forbids it.

Run ``python tests/test_layout.py`` for the numbers (modules, edges, circles, forbidden and upward edges).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "harness"

# The rooms of the target layout, bottom floor first. A room's floor says which rooms it may lean on.
FLOORS: dict[str, int] = {
    "base": 0,  # the package itself (version), redact
    "config": 0,  # config/: schema, paths, checks
    "kernels": 1,
    "results": 1,  # results/: schema, envinfo, tracking
    "datasets": 2,
    "models": 3,
    "metrics": 4,
    "latency": 4,
    "techniques": 5,  # techniques/{sere, visionzip, offload}, moe_topk
    "engines": 6,
    "run": 7,  # the run's parts: validate, state, cache, progress, logs, outcome, scoring's users
    "run_loop": 8,  # the run loop itself (run.py, later run/experiment.py)
    "report": 9,
    "opencompass": 9,
    "commands": 10,  # the python -m tools that are not the run
    "cli": 11,
}

# Module-name prefix → room; the longest prefix wins. Since the folder moves every room is a folder (or the
# package's own top: the CLI), so the room of a module is read off its path.
ROOM_OF_PREFIX: dict[str, str] = {
    "harness": "base",
    "harness.__main__": "cli",
    "harness.cli": "cli",
    "harness.redact": "base",
    "harness.config": "config",
    "harness.engines": "engines",
    "harness.kernels": "kernels",
    "harness.models": "models",
    "harness.datasets": "datasets",
    "harness.metrics": "metrics",
    "harness.latency": "latency",
    "harness.techniques": "techniques",
    "harness.results": "results",
    "harness.report": "report",
    "harness.run": "run",
    "harness.run.experiment": "run_loop",
    "harness.opencompass": "opencompass",
    "harness.commands": "commands",
}

# Modules judged by another room than their folder's (none since the folder moves of issue 24).
ROOM_OVERRIDES: dict[str, str] = {}

TECHNIQUES = ("techniques",)
ABOVE_RUN = ("run", "run_loop", "cli", "commands", "report", "opencompass")


@dataclass(frozen=True)
class Rule:
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    rule: str


# Each rule of the note, as data: an edge from a module of a source room to one of a target room must not exist.
FORBIDDEN: tuple[Rule, ...] = (
    Rule(tuple(r for r in FLOORS if r != "cli"), ("cli",),
         "nothing reaches back up to the CLI (engines/vllm/disagg.py imported cli.CONF_DIR): shared names live below"),
    Rule(("kernels",), ("engines", "techniques", "metrics") + ABOVE_RUN,
         "kernels import no engine, no technique, no metric (a kernel's reference lives beside the kernel)"),
    Rule(TECHNIQUES, ("engines",) + ABOVE_RUN,
         "techniques import no engine and no run: algorithms are written once, engines hook them in"),
    Rule(("metrics",), ("engines", "techniques") + ABOVE_RUN,
         "metrics import nothing about how an answer was produced (engines, techniques)"),
    Rule(("datasets",), ("engines", "techniques") + ABOVE_RUN, "datasets import no engine"),
    Rule(("models",), ("engines", "techniques") + ABOVE_RUN, "models import no engine"),
    Rule(("report",), ("engines", "techniques", "run", "run_loop", "cli", "commands", "opencompass"),
         "report reads result files only (no engine, no run)"),
    Rule(("engines",), ABOVE_RUN, "engines never reach back up to the run loop or the CLI"),
    Rule(("opencompass", "commands"), ("run_loop", "cli"),
         "OpenCompass and commands share the run's parts, not its loop"),
    Rule(("config", "base", "results"), tuple(r for r in FLOORS if r not in ("config", "base", "results")),
         "config and results sit at the bottom: they import nothing of the layers above them"),
)

# Edges a rule forbids that can only be removed inside a file another developer owns right now. Each entry:
# (importing module, imported module, why it stays) — issue 24 removes them when the file is free.
KNOWN_EXCEPTIONS: tuple[tuple[str, str, str], ...] = ()


# ---------------------------------------------------------------------------------------------- the graph
@dataclass(frozen=True)
class Edge:
    source: str
    target: str
    line: int
    module_level: bool


def package_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted name → (file, is a package) for every module under ``harness/``."""
    mods: dict[str, tuple[Path, bool]] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = (path, is_pkg)
    return mods


def _owner(name: str, mods: dict) -> str | None:
    """The module of the package that ``name`` (a module or ``module.attr``) lives in."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``"""
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and len(test.comparators) == 1
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value == "__main__")


def _imports(tree: ast.Module):
    """(node, at module level?) for every import statement; function and class bodies are not module level.
    The body of a module-level ``if __name__ == "__main__":`` is skipped (see the module doc)."""
    def walk(node, module_level):
        for child in ast.iter_child_nodes(node):
            if node is tree and _is_main_guard(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, module_level
            inner = module_level and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                                            ast.ClassDef))
            yield from walk(child, inner)
    yield from walk(tree, True)


def import_edges(mods: dict[str, tuple[Path, bool]]) -> list[Edge]:
    """Every internal import of every module, one edge per (source, target, line)."""
    edges: dict[tuple[str, str, int], Edge] = {}
    for name, (path, is_pkg) in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        package = name if is_pkg else name.rpartition(".")[0]
        for node, module_level in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    full = ".".join(base + ([node.module] if node.module else []))
                else:
                    full = node.module or ""
                targets = [f"{full}.{a.name}" if f"{full}.{a.name}" in mods else full for a in node.names]
            for target in targets:
                if target != PACKAGE and not target.startswith(PACKAGE + "."):
                    continue
                owner = _owner(target, mods)
                if owner and owner != name:
                    edges.setdefault((name, owner, node.lineno), Edge(name, owner, node.lineno, module_level))
    return list(edges.values())


def room_of(module: str) -> str:
    if module in ROOM_OVERRIDES:
        return ROOM_OVERRIDES[module]
    name = module
    while name:
        if name in ROOM_OF_PREFIX:
            return ROOM_OF_PREFIX[name]
        name = name.rpartition(".")[0]
    raise KeyError(module)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


@dataclass
class Layout:
    modules: dict[str, tuple[Path, bool]]
    edges: list[Edge]

    @property
    def graph(self) -> dict[str, set[str]]:
        g: dict[str, set[str]] = {m: set() for m in self.modules}
        for e in self.edges:
            g[e.source].add(e.target)
        return g

    def pairs(self) -> dict[tuple[str, str], list[Edge]]:
        out: dict[tuple[str, str], list[Edge]] = defaultdict(list)
        for e in self.edges:
            out[(e.source, e.target)].append(e)
        return out

    def forbidden(self) -> list[tuple[str, str, Rule, list[Edge]]]:
        known = {(s, t) for s, t, _ in KNOWN_EXCEPTIONS}
        out = []
        for (src, dst), where in sorted(self.pairs().items()):
            if (src, dst) in known:
                continue
            for rule in FORBIDDEN:
                if room_of(src) in rule.sources and room_of(dst) in rule.targets:
                    out.append((src, dst, rule, where))
                    break
        return out

    def upward(self) -> list[tuple[str, str]]:
        return [(s, t) for s, t in sorted(self.pairs()) if FLOORS[room_of(s)] < FLOORS[room_of(t)]]

    def report(self) -> str:
        pairs = self.pairs()
        function_level = sum(1 for w in pairs.values() if not any(e.module_level for e in w))
        rooms_used = {room_of(m) for m in self.modules}
        circ = circles(self.graph)
        forb = self.forbidden()
        up = self.upward()
        lines = [
            f"modules: {len(self.modules)} in {len(rooms_used)} rooms",
            f"edges (importing module → imported module): {len(pairs)}, of which only inside functions: "
            f"{function_level} ({100 * function_level / max(1, len(pairs)):.0f} %)",
            f"circles (strongly connected components > 1 module): {len(circ)}",
            *[f"  circle of {len(c)}: {' ↔ '.join(c)}" for c in circ],
            f"forbidden edges: {len(forb)}",
            *[f"  {s} → {t}  (line {', '.join(str(e.line) for e in w)}; {room_of(s)} → {room_of(t)}: {r.rule})"
              for s, t, r, w in forb],
            f"function-level imports that keep nothing lazy: {len(needless_function_imports(self))}",
            f"known exceptions (issue 24): {len(KNOWN_EXCEPTIONS)}",
            *[f"  {s} → {t}: {why}" for s, t, why in KNOWN_EXCEPTIONS],
            f"upward edges (a lower floor importing a higher one): {len(up)}",
            *[f"  {s} → {t}  ({room_of(s)}@{FLOORS[room_of(s)]} → {room_of(t)}@{FLOORS[room_of(t)]})"
              for s, t in up],
        ]
        return "\n".join(lines)


def read_layout(root: Path = ROOT) -> Layout:
    mods = package_modules(root)
    return Layout(mods, import_edges(mods))


# ---------------------------------------------------------------------------------------------- lazy imports
# An internal import belongs at module level unless it keeps a third-party package from loading where it is not
# needed (torch for the CLI's refusals and the report, vLLM, open_clip, wandb, Triton on CPU, Hydra for the GPU
# benchmarks): a function-level import whose module brings nothing the importing module does not already load
# hides the module's dependencies for no gain (issue 24: 367 of 583 internal import statements, 54 % of the
# import edges, sat inside functions).
def _third_party(name: str) -> str | None:
    top = name.split(".")[0]
    return None if not top or top == PACKAGE or top in sys.stdlib_module_names or top == "__future__" else top


def module_level_packages(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module → the third-party packages it imports at module level."""
    out: dict[str, set[str]] = {}
    for name, (path, _) in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found: set[str] = set()
        for node, module_level in _imports(tree):
            if not module_level:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [] if node.level else [node.module or ""])
            found |= {t for t in map(_third_party, names) if t}
        out[name] = found
    return out


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_time_packages(layout: Layout, packages: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module → the third-party packages importing it loads: its own, its parent packages' and those of every
    module it imports at module level, transitively."""
    direct: dict[str, set[str]] = defaultdict(set)
    for e in layout.edges:
        if e.module_level:
            direct[e.source].add(e.target)
    out: dict[str, set[str]] = {}
    for start in layout.modules:
        seen: set[str] = set()
        todo = [start, *_parents(start)]
        while todo:
            m = todo.pop()
            if m in seen or m not in layout.modules:
                continue
            seen.add(m)
            for t in direct[m]:
                todo += [t, *_parents(t)]
        out[start] = set().union(*(packages[m] for m in seen))
    return out


def _import_error_fallbacks(tree: ast.Module) -> set[int]:
    """Lines of imports inside a ``try`` whose handler catches ImportError (a fallback chain, e.g. the Triton
    kernel or its torch reference): those choose at run time and stay where they are."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                h.type is None or "ImportError" in ast.unparse(h.type) or "ModuleNotFoundError" in ast.unparse(h.type)
                for h in node.handlers):
            for part in (node.body, *(h.body for h in node.handlers)):
                for stmt in part:
                    for inner in ast.walk(stmt):
                        if isinstance(inner, (ast.Import, ast.ImportFrom)):
                            lines.add(inner.lineno)
    return lines


def needless_function_imports(layout: Layout) -> list[tuple[str, str, int]]:
    """(module, imported module, line) of every function-level internal import that keeps nothing lazy: what it
    imports loads no third-party package the importing module does not load already."""
    packages = module_level_packages(layout.modules)
    loads = import_time_packages(layout, packages)
    fallbacks = {m: _import_error_fallbacks(ast.parse(p.read_text(encoding="utf-8"))) for m, (p, _) in
                 layout.modules.items()}
    out = []
    for e in layout.edges:
        if e.module_level or e.line in fallbacks[e.source]:
            continue
        brings = loads[e.target].union(*(packages[p] for p in _parents(e.target) if p in packages))
        if not brings - loads[e.source]:
            out.append((e.source, e.target, e.line))
    return sorted(out)


# ---------------------------------------------------------------------------------------------- the tests
def test_every_module_has_a_room():
    unplaced = []
    for m in package_modules():
        try:
            assert room_of(m) in FLOORS, (m, room_of(m))
        except KeyError:
            unplaced.append(m)
    assert not unplaced, ("modules in no room of the layout (add them to ROOM_OF_PREFIX in tests/test_layout.py): "
                          + ", ".join(unplaced))


def test_no_import_circle():
    layout = read_layout()
    found = circles(layout.graph)
    pairs = layout.pairs()
    msg = []
    for c in found:
        inside = sorted((s, t) for s, t in pairs if s in c and t in c)
        msg.append(f"circle of {len(c)} modules: " + ", ".join(c) + "\n    edges inside it:\n"
                   + "\n".join(f"      {s} → {t} (line {', '.join(str(e.line) for e in pairs[(s, t)])})"
                               for s, t in inside))
    assert not found, "import circles (function-level imports count too):\n" + "\n".join(msg)


def test_no_forbidden_import():
    forb = read_layout().forbidden()
    assert not forb, "imports that shared/notes/layout.md forbids:\n" + "\n".join(
        f"  {s} (line {', '.join(str(e.line) for e in w)}) → {t}\n      {room_of(s)} → {room_of(t)}: {r.rule}"
        for s, t, r, w in forb)


def test_known_exceptions_still_exist():
    """An exception whose edge is gone must leave the list, so the list never hides a new edge."""
    pairs = read_layout().pairs()
    stale = [(s, t) for s, t, _ in KNOWN_EXCEPTIONS if (s, t) not in pairs]
    assert not stale, f"these known exceptions no longer exist; remove them from KNOWN_EXCEPTIONS: {stale}"


def test_graph_numbers(capsys):
    layout = read_layout()
    assert len(layout.modules) > 100 and len(layout.edges) > 100  # the reader sees the package
    with capsys.disabled():
        print("\n" + layout.report())


def test_reader_resolves_relative_and_submodule_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import a\n")
    (pkg / "sub" / "a.py").write_text("def f():\n    from ..b import thing\n")
    (pkg / "b.py").write_text("from harness.sub import a\nimport os\n")
    mods = package_modules(tmp_path)
    got = {(e.source, e.target, e.module_level) for e in import_edges(mods)}
    assert got == {("harness.sub", "harness.sub.a", True), ("harness.sub.a", "harness.b", False),
                   ("harness.b", "harness.sub.a", True)}
    assert circles(Layout(mods, import_edges(mods)).graph) == [["harness.b", "harness.sub.a"]]


def test_checker_flags_a_forbidden_edge_and_skips_a_main_guard(tmp_path):
    pkg = tmp_path / PACKAGE
    for d in ("kernels", "techniques"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "op.py").write_text("def f():\n    from harness.techniques.algo import ref\n")
    (pkg / "techniques" / "algo.py").write_text(
        "from harness.kernels import op\n\nif __name__ == '__main__':\n    import harness.kernels\n")
    layout = read_layout(tmp_path)
    assert [(s, t, r.rule.split(":")[0]) for s, t, r, _ in layout.forbidden()] == [
        ("harness.kernels.op", "harness.techniques.algo",
         "kernels import no engine, no technique, no metric (a kernel's reference lives beside the kernel)")]
    assert circles(layout.graph) == [["harness.kernels.op", "harness.techniques.algo"]]
    assert "harness.kernels" not in layout.graph["harness.techniques.algo"]  # the script's import, not the module's


def test_function_level_imports_keep_something_lazy():
    """Every internal import inside a function keeps a third-party package from loading at import time (or picks
    between alternatives under ``except ImportError``); the rest sit at module level, where a reader sees them."""
    needless = needless_function_imports(read_layout())
    assert not needless, "function-level imports that load nothing new (move them to the module's imports):\n" + \
        "\n".join(f"  {s}:{line} → {t}" for s, t, line in needless)


def test_lazy_import_check_sees_a_needless_and_a_needed_import(tmp_path):
    pkg = tmp_path / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "light.py").write_text("import json\n")
    (pkg / "heavy.py").write_text("import torch\n")
    (pkg / "user.py").write_text("def f():\n    from harness import light\n\n\ndef g():\n    from harness import heavy\n"
                                 "\n\ndef h():\n    try:\n        from harness import light\n    except ImportError:\n"
                                 "        light = None\n")
    assert needless_function_imports(read_layout(tmp_path)) == [("harness.user", "harness.light", 2)]


if __name__ == "__main__":
    print(read_layout().report())
    sys.exit(0)
