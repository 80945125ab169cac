"""Compile Triton kernels for a GPU this machine does not have, and read what the compiler made of them.

Why: a kernel's time on the GPU can only be measured there, but *where* it can go is fixed at compile time —
registers and spills (local memory), shared memory, how many instructions, global loads, shuffles and barriers,
and which of them wait on each other. The routing op of issue 23 misses its 5 µs target and the sessions that
could have profiled it on the H200 were not lent one; this reads the same cubin the H200 runs (same Triton,
same target) on any machine.

- :func:`compile_only` makes every ``@triton.jit`` launch inside it compile for ``sm_<arch>`` and return without
  running (a driver that reports that target; the launch is turned into Triton's own warm-up, which compiles and
  returns the kernel). The calling code runs as it would on the GPU — the same dispatch, tiling and
  constexprs — on CPU tensors, whose contents are then meaningless (nothing ran).
- :func:`profile_kernel` reads one compiled kernel: ``cuobjdump -res-usage`` (registers, stack, shared, local),
  the SASS of ``nvdisasm -g`` (opcode classes, loops = backward branches, instructions per source function:
  :func:`by_function`) and :func:`critical_path`.

Source lines come from the cubin's line table: Triton 3.6.0's (the GPU machine's) named the right lines where
checked; 3.8's put both loads of a two-line test kernel on the blank line after it, so the per-function
figures want 3.6.0. Imports: triton (and torch for the CPU tensors' device); the NVIDIA tools come with Triton's
wheel.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

__all__ = ["by_function", "compile_only", "critical_path", "disassemble", "parse_sass", "profile_kernel",
           "resource_usage"]

#: opcodes that write no register or predicate (stores, reductions to memory, control flow, fences)
NO_DEST = {"ST", "STG", "STS", "STL", "RED", "REDG", "BAR", "BRA", "BRX", "EXIT", "RET", "BSSY", "BSYNC",
           "WARPSYNC", "NOP", "CALL", "MEMBAR", "ERRBAR", "CCTL", "CCTLL", "DEPBAR", "YIELD", "JMP", "BPT",
           "FENCE", "ACQBULK", "UCGABAR_ARV", "UCGABAR_WAIT"}
#: opcodes whose second operand is also written (a shuffle's "lane in range" predicate and its value)
TWO_DEST = {"SHFL"}
_REG = re.compile(r"(?<![A-Z_])(U?R\d+|U?P\d+|PR)(?:\.(64|128))?")
_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)\s*(.*?)\s*;")
_CLASS = {"LDG": "global_load", "LD": "global_load", "LDS": "shared_load", "LDSM": "shared_load",
          "LDL": "local_load", "STL": "local_store", "SHFL": "shuffle", "BAR": "barrier", "STG": "global_store",
          "STS": "shared_store", "ATOMG": "atomic", "ATOM": "atomic", "RED": "atomic", "REDG": "atomic",
          "ATOMS": "atomic", "REDUX": "warp_reduce", "MUFU": "special_function"}


@contextlib.contextmanager
def compile_only(arch: int = 90, warp_size: int = 32) -> Iterator[list[tuple[str, Any]]]:
    """Inside: every ``@triton.jit`` launch compiles for ``sm_<arch>`` and returns without running; yields the
    list of ``(kernel name, CompiledKernel)`` compiled so far, in launch order. Needs ``TRITON_INTERPRET``
    unset (an interpreted kernel never compiles). Meant for a process that launches nothing for real afterwards:
    each kernel keeps what it compiled here in its in-memory cache for device 0 (the script and the test run it
    in a process of their own)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class _CompileOnlyDriver(DriverBase):
        def __init__(self) -> None:  # no CUDA library to load
            pass

        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self):
            return GPUTarget("cuda", arch, warp_size)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            raise RuntimeError("compile_only: nothing runs, nothing can be timed")

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

    compiled: list[tuple[str, Any]] = []
    run = JITFunction.run

    def compile_and_return(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    previous = driver._active
    driver.set_active(_CompileOnlyDriver())
    JITFunction.run = compile_and_return
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver._active = previous


def _tool(name: str) -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "bin", name)


def _run_on(cubin: bytes, tool: str, *flags: str) -> str:
    """The stdout of one of Triton's NVIDIA tools run on ``cubin`` (written to a temporary file)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_tool(tool), *flags, f.name], check=True, capture_output=True, text=True).stdout


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -g -c``: the code sections, each instruction under its source line."""
    return _run_on(cubin, "nvdisasm", "-g", "-c")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """``cuobjdump -res-usage``: REG, STACK, SHARED, LOCAL (bytes; REG in registers per thread)."""
    text = _run_on(cubin, "cuobjdump", "-res-usage")
    got = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in got.items()}


def parse_sass(sass: str) -> list[dict[str, Any]]:
    """One dict per instruction of ``nvdisasm -g -c`` output: ``addr``, ``op`` (without modifiers), ``mods``,
    ``dests`` and ``srcs`` (register names, a 64-/128-bit operand expanded to its registers; RZ, PT, URZ, UPT
    left out: constants), ``guard`` (runs under a predicate), ``target`` (a branch's address) and ``file`` /
    ``line`` (the source line the compiler's line table gives it)."""
    out, labels, where = [], {}, (None, None)
    pending: list[str] = []
    for line in sass.splitlines():
        loc = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if loc:
            where = (loc.group(1), int(loc.group(2)))
            continue
        lab = re.match(r"^(\.L_x_\d+):", line)
        if lab:
            pending.append(lab.group(1))
            continue
        m = _LINE.match(line)
        if not m:
            continue
        addr, guard, op, mods, rest = int(m.group(1), 16), m.group(2), m.group(3), m.group(4), m.group(5)
        for name in pending:
            labels[name] = addr
        pending = []
        operands = _split_operands(rest)
        n_dest = 0 if op in NO_DEST else 2 if op in TWO_DEST else 1
        if n_dest == 1 and len(operands) > 1 and re.fullmatch(r"U?P(T|\d+)", operands[1].strip("!")):
            n_dest = 2       # a compare's second predicate, an add's carry-out, a LOP3's predicate result
        width = 4 if ".128" in mods else 2 if (".64" in mods or ".WIDE" in mods) else 1
        dests = [r for o in operands[:n_dest] for r in _regs(o, width)]
        srcs = [r for o in operands[n_dest:] for r in _regs(o, 1)]
        if guard:
            srcs += _regs(guard.strip().lstrip("@"), 1)
        target = None
        if op in ("BRA", "BSSY", "CALL") and operands:
            t = re.search(r"\((\.L_x_\d+)\)", operands[-1])
            target = t.group(1) if t else None
        out.append({"addr": addr, "op": op, "mods": mods, "dests": dests, "srcs": srcs,
                    "guard": guard.strip().lstrip("@") if guard else None, "target": target, "file": where[0],
                    "line": where[1]})
    for ins in out:
        ins["target"] = labels.get(ins["target"]) if ins["target"] else None
    return out


def _split_operands(rest: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in rest:
        depth += ch in "[" and 1 or 0
        depth -= ch in "]" and 1 or 0
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def _regs(operand: str, width: int) -> list[str]:
    regs = []
    for name, wide in _REG.findall(operand):
        if name == "PR":           # every predicate at once (P2R / R2P)
            regs += [f"P{i}" for i in range(7)]
            continue
        n = 4 if wide == "128" else 2 if wide == "64" else width
        prefix, num = re.match(r"(U?[RP])(\d+)", name).groups()
        regs += [f"{prefix}{int(num) + i}" for i in range(n)]
    return regs


def _longer(a: tuple, b: tuple) -> tuple:
    return a if a[0] >= b[0] else b


def critical_path(instrs: list[dict[str, Any]]) -> dict[str, Any]:
    """The longest chain of instructions each of which reads what an earlier one wrote, in program order.

    Register dataflow (a predicated write keeps the register's older chain unless the opposite predicate wrote
    it too), plus shared memory as one location whose chain is the longest of the stores into it so far (a
    shared store, then the barrier, then a shared load is a dependency: a cross-warp reduction's way); global
    memory is not linked (a load is taken not to read what this kernel stored — true of the routing kernels but
    for the counters). Branches are not followed: code is read once in address order, so a loop's body counts
    once (``loops`` says how many there are), both sides of an ``if`` count as if both ran, and a load that waits
    on a branch (not on a register) is not linked to what the branch tested. So it is a static estimate of the
    latency chain, not a trace: the length in instructions, what the chain is made of (global loads, shared
    loads, shuffles, barriers) and where its global loads are (``global_loads_at``: source function and line)."""
    # a chain: (length, its mix of instruction classes, the index of its last instruction)
    chain: dict[str, tuple[int, collections.Counter, int]] = {}
    # per register, its last write under a predicate (the predicate, that write's chain): a write under the
    # opposite predicate then completes the register (``@P0 LDG R5`` + ``@!P0 MOV R5``: a masked load and its
    # ``other``), and the value before both is gone
    guarded: dict[str, tuple[str, tuple]] = {}
    before: dict[int, int] = {}      # instruction -> the one its chain came through
    best: tuple[int, collections.Counter, int] = (0, collections.Counter(), -1)
    for i, ins in enumerate(instrs):
        reads = list(ins["srcs"])
        if ins["op"] in ("LDS", "LDSM", "BAR", "ATOMS"):
            reads.append("smem")
        length, mix, prev = max((chain[r] for r in reads if r in chain), key=lambda x: x[0],
                                default=(0, collections.Counter(), -1))
        before[i] = prev
        mix = mix.copy()
        kind = _CLASS.get(ins["op"])
        if kind:
            mix[kind] += 1
        here = (length + 1, mix, i)
        writes = list(ins["dests"])
        if ins["op"] in ("STS", "BAR", "ATOMS"):
            writes.append("smem")
        for r in writes:
            # a predicated write may not happen, and one store to shared memory does not undo another (other
            # threads' stores land at other addresses): the longer of the old chain and this one stays
            g = ins["guard"]
            if r == "smem" or (g and r in chain):
                last = guarded.get(r)
                if g and last and last[0] == (g[1:] if g.startswith("!") else "!" + g):
                    chain[r] = _longer(last[1], here)      # both halves written: the older value is gone
                else:
                    chain[r] = _longer(chain[r], here) if r in chain else here
            else:
                chain[r] = here
            if g and r != "smem":
                guarded[r] = (g, here)
            else:
                guarded.pop(r, None)
        for p in (r for r in writes if r.startswith(("P", "UP"))):  # a new predicate: no longer the opposite
            guarded = {r: v for r, v in guarded.items() if v[0].lstrip("!") != p}
        if here[0] > best[0]:
            best = here
    loads_at, i = [], best[2]
    while i >= 0:
        ins = instrs[i]
        if _CLASS.get(ins["op"]) == "global_load":
            fn = _function_at(ins["file"], ins["line"]) if ins.get("file") else None
            loads_at.append(f"{fn or '?'}:{ins['line']}" if ins.get("line") else "?")
        i = before[i]
    return {"length": best[0], **{f"on_path_{k}": v for k, v in sorted(best[1].items())},
            **({"global_loads_at": loads_at[::-1]} if loads_at else {})}


def _function_at(path: str, line: int) -> str | None:
    """The innermost function of ``path`` that holds ``line`` (the kernel's own code; None elsewhere)."""
    if path not in _FUNCTIONS:
        spans = []
        try:
            tree = ast.parse(open(path).read())
            spans = [(n.lineno, n.end_lineno, n.name) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
        except (OSError, SyntaxError):
            pass
        _FUNCTIONS[path] = spans
    inside = [s for s in _FUNCTIONS[path] if s[0] <= line <= s[1]]
    return min(inside, key=lambda s: s[1] - s[0])[2] if inside else None


_FUNCTIONS: dict[str, list[tuple[int, int, str]]] = {}


def by_function(instrs: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Instructions per function of the kernel's own source (``@triton.jit`` helpers are inlined; the line table
    still names their lines). Lines of Triton's own library (``tl.max``'s combine, ``tl.sum``...) count for the
    own line the compiler emitted last before them: the call that inlined them, in the usual instruction order."""
    import triton

    lib = os.path.dirname(triton.__file__)
    rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    current = "(prologue)"
    for ins in instrs:
        if ins["file"] and not ins["file"].startswith(lib):
            current = _function_at(ins["file"], ins["line"]) or current
        row = rows[current]
        row["instructions"] += ins["op"] != "NOP"
        kind = _CLASS.get(ins["op"])
        if kind:
            row[kind] += 1
    return {name: dict(row) for name, row in sorted(rows.items(), key=lambda kv: -kv[1]["instructions"])}


def profile_kernel(name: str, kernel: Any) -> dict[str, Any]:
    """Everything this module reads off one compiled kernel."""
    cubin = kernel.asm["cubin"]
    instrs = parse_sass(disassemble(cubin))
    ops = collections.Counter(i["op"] for i in instrs)
    classes = collections.Counter(_CLASS[i["op"]] for i in instrs if i["op"] in _CLASS)
    md = kernel.metadata
    return {"kernel": name, "num_warps": md.num_warps, **resource_usage(cubin),
            "instructions": len(instrs) - ops.get("NOP", 0),
            "loops": sum(1 for i in instrs if i["op"] == "BRA" and i["target"] is not None and i["target"] < i["addr"]),
            **{k: classes.get(k, 0) for k in sorted(set(_CLASS.values()))},
            "critical_path": critical_path(instrs), "by_function": by_function(instrs),
            "top_opcodes": dict(ops.most_common(12))}
