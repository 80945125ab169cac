"""benchmarks/_sass.py: reading SASS (operands, labels, loops, predicated writes), the dependency chain it
counts, and — compiled for sm_90 on this CPU machine with the Triton this venv has — real kernels whose chains
are known: a gather whose index is itself loaded (two dependent global loads) against two independent loads,
and the routing op's own dispatch driving the compilation (one kernel, or two launches in order)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _sass  # noqa: E402

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "/x/k.py", line 3
        /*0010*/                   LDG.E.64 R4, desc[UR4][R2.64] ;
        /*0020*/                   ISETP.GE.AND P0, PT, R4, 0x1, PT ;
.L_x_0:
	//## File "/x/k.py", line 4
        /*0030*/                   SHFL.BFLY PT, R7, R5, 0x1, 0x1f ;
        /*0040*/               @P0 IADD3 R8, P1, R7, R6, RZ ;
        /*0050*/                   STS [R9], R8 ;
        /*0060*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0070*/                   LDS R10, [R11] ;
        /*0080*/              @!P0 BRA `(.L_x_0) ;
        /*0090*/                   STG.E desc[UR4][R12.64], R10 ;
        /*00a0*/                   EXIT ;
"""


def test_operands_labels_and_loops_are_read():
    ins = {i["addr"]: i for i in _sass.parse_sass(SASS)}
    assert ins[0x10]["op"] == "LDG" and ins[0x10]["dests"] == ["R4", "R5"]          # a 64-bit load: two registers
    assert set(ins[0x10]["srcs"]) == {"UR4", "R2", "R3"}
    assert ins[0x20]["dests"] == ["P0"] and "R4" in ins[0x20]["srcs"]               # PT: a constant, not a register
    assert ins[0x30]["dests"] == ["R7"] and ins[0x30]["srcs"] == ["R5"]             # a shuffle writes its value
    assert ins[0x40]["dests"] == ["R8", "P1"] and ins[0x40]["guard"] and "P0" in ins[0x40]["srcs"]
    assert ins[0x50]["dests"] == [] and set(ins[0x50]["srcs"]) == {"R9", "R8"}       # a store writes no register
    assert ins[0x80]["target"] == 0x30                                               # the label's address
    assert (ins[0x10]["file"], ins[0x10]["line"]) == ("/x/k.py", 3) and ins[0x30]["line"] == 4


def test_the_chain_runs_through_shared_memory_and_barriers():
    path = _sass.critical_path(_sass.parse_sass(SASS))
    # LDG -> SHFL -> IADD3 -> STS -> BAR -> LDS -> STG: the barrier and the shared load wait on the store
    assert path["length"] == 7
    assert path["on_path_global_load"] == 1 and path["on_path_barrier"] == 1 and path["on_path_shared_load"] == 1
    assert path["on_path_shuffle"] == 1
    assert path["global_loads_at"] == ["?:3"]      # line 3 of a file that is not here: no function to name


def test_a_predicated_write_keeps_the_longer_chain_of_what_it_may_not_replace():
    sass = textwrap.dedent("""
        /*0000*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0010*/                   LDG.E R5, desc[UR4][R4.64] ;
        /*0020*/               @P0 MOV R5, RZ ;
        /*0030*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0040*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0050*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0060*/                   STG.E desc[UR4][R6.64], R5 ;
    """)
    guarded = _sass.critical_path(_sass.parse_sass(sass))
    # R5 may still be the gathered value
    assert guarded == {"length": 6, "on_path_global_load": 2, "on_path_global_store": 1, "global_loads_at": ["?", "?"]}
    unguarded = _sass.critical_path(_sass.parse_sass(sass.replace("@P0 MOV", "    MOV")))
    assert unguarded == {"length": 5, "on_path_global_store": 1}  # the MOV ends the loads' chain


def test_a_masked_load_and_its_other_value_replace_the_register_whole():
    sass = textwrap.dedent("""
        /*0000*/                   LDG.E R4, desc[UR4][R2.64] ;
        /*0010*/                   LDG.E R6, desc[UR4][R4.64] ;
        /*0020*/                   LDG.E R5, desc[UR4][R6.64] ;
        /*0030*/               @P0 LDG.E R5, desc[UR4][R8.64] ;
        /*0040*/              @!P0 MOV R5, 0xff800000 ;
        /*0050*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0060*/                   IADD3 R5, R5, 0x1, RZ ;
        /*0070*/                   IADD3 R5, R5, 0x1, RZ ;
    """)
    # R5's old value (three chained loads) is gone once both halves wrote it: the adds wait on one load
    assert _sass.critical_path(_sass.parse_sass(sass)) == {"length": 4, "on_path_global_load": 1,
                                                           "global_loads_at": ["?"]}
    # P0 rewritten between the halves: the MOV no longer completes the register, the old chain may survive
    rewritten = sass.replace("/*0040*/", "/*0038*/  ISETP.NE.AND P0, PT, R7, RZ, PT ;\n/*0040*/")
    ins = _sass.parse_sass(rewritten)
    assert [i["op"] for i in ins][3:6] == ["LDG", "ISETP", "MOV"]
    assert _sass.critical_path(ins) == {"length": 6, "on_path_global_load": 3, "global_loads_at": ["?", "?", "?"]}


KERNELS = '''
import json, sys, torch, triton, triton.language as tl
sys.path.insert(0, sys.argv[1])
from _sass import compile_only, profile_kernel

@triton.jit
def gather(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    idx = tl.load(a_ptr + i)
    tl.store(out_ptr + i, tl.load(b_ptr + idx))

@triton.jit
def add(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(a_ptr + i).to(tl.float32) + tl.load(b_ptr + i))

a, b, out = torch.zeros(64, dtype=torch.int32), torch.zeros(64), torch.zeros(64)
with compile_only(90) as got:
    gather[(1,)](a, b, out, BLOCK=64, num_warps=1)
    add[(1,)](a, b, out, BLOCK=64, num_warps=1)
from harness.kernels.fused_routing import COUNTERS, RoutingSpec, fused_routing_triton
sim = torch.rand(128, 128)
spec = RoutingSpec(8, True, k_primary=2, rho=0.0, similarity=sim)
launches = {}
for multi in (False, True):
    with compile_only(90) as op:
        w, ids = fused_routing_triton(torch.randn(4, 128).bfloat16(), spec, torch.ones(4, dtype=torch.bool), None,
                                      torch.zeros(len(COUNTERS), dtype=torch.long), None, multi=multi)
    launches[str(multi)] = [name for name, _ in op]
print(json.dumps({"kernels": [profile_kernel(n, k) for n, k in got], "launches": launches}))
'''


def test_real_kernels_compiled_for_sm90_on_this_machine(tmp_path):
    script = tmp_path / "kernels.py"
    script.write_text(KERNELS)
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(BENCH.parent), os.environ.get("PYTHONPATH", "")])}
    got = subprocess.run([sys.executable, str(script), str(BENCH)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    doc = json.loads(got.stdout.strip().splitlines()[-1])
    gather, add = doc["kernels"]
    assert gather["kernel"] == "gather" and gather["reg"] > 0 and gather["local"] == 0
    assert gather["critical_path"]["on_path_global_load"] == 2     # the index, then the value it points at
    # where they are: two entries (the names need the line table of the device's Triton 3.6.0; 3.8's put both
    # loads of this kernel on the blank line after it)
    assert len(gather["critical_path"]["global_loads_at"]) == 2
    assert add["critical_path"]["on_path_global_load"] == 1        # two loads side by side
    assert gather["global_load"] >= 2 and add["global_load"] >= 2 and gather["loops"] == 0
    assert "gather" in gather["by_function"]
    # the op's own dispatch drove the compilation: one kernel, or SERE's multi-program plan in order (pass 1, the
    # re-route, the counters' one-program launch)
    assert doc["launches"] == {"False": ["_fused_routing_kernel"],
                               "True": ["_epoch_topk_kernel", "_epoch_reroute_kernel", "_epoch_stats_kernel"]}
