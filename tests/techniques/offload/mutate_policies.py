"""Mutation check of the offload policies' contracts: every mutant below breaks one rule of a policy's docstring
contract, and ``test_policy_contracts.py`` must fail on each (a surviving mutant is a rule no test pins).

    python tests/techniques/offload/mutate_policies.py      # ~2 min on 2 cores; exit 1 if a mutant survives
    python tests/techniques/offload/mutate_policies.py lease:   # only the mutants whose rule names "lease:"

Not collected by pytest (no ``test_`` prefix): it runs the contract tests once per mutant. The package is copied
to a temporary directory and mutated there, so the checkout is never edited (other processes may import it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TESTS = Path(__file__).resolve().parent / "test_policy_contracts.py"
P, L, C = "policies.py", "lease.py", "cache.py"

#: (file, original text, mutated text, the rule it breaks)
MUTANTS: list[tuple[str, str, str, str]] = [
    (P, "lambda e: (lu.get(e, -1), e))", "lambda e: (lu.get(e, -1), -e))", "lru: ties to the lowest id"),
    (P, "lambda e: (lu.get(e, -1), e))", "lambda e: (lu.get(e, 1 << 60), e))", "lru: never used goes first"),
    (P, "self.last_use[layer].pop(expert, None)", "pass", "lru: eviction forgets recency"),
    (P, "        self.touch(nxt, experts)\n", "", "lru+gate: a guess counts as just used"),
    (P, "(-score[e][0], score[e][1], e)", "(score[e][0], score[e][1], e)", "gate rank: count first"),
    (P, "(-score[e][0], score[e][1], e)", "(-score[e][0], -score[e][1], e)", "gate rank: best rank next"),
    (P, "(-score[e][0], score[e][1], e)", "(-score[e][0], score[e][1], -e)", "gate rank: then the lowest id"),
    (P, "i = bisect.bisect_left(uses, now)", "i = bisect.bisect_right(uses, now)", "oracle: a use now counts"),
    (P, "return clock.tokens - 1 if clock.phase", "return clock.tokens if clock.phase", "oracle: decode t is step t-1"),
    (P, "lambda e: (-self.next_use(layer, e, now), e))", "lambda e: (-self.next_use(layer, e, now), -e))",
     "oracle: ties to the lowest id"),
    (P, "if clock.phase != \"decode\":\n            return\n        now = self._now(clock)\n        if now >= len",
     "now = self._now(clock)\n        if now >= len", "oracle: only decode is checked"),
    (P, "lambda e: (counts.get(e, 0), lu.get(e, -1), e))", "lambda e: (counts.get(e, 0), -lu.get(e, -1), e))",
     "lfu: least recent on equal counts"),
    (P, "lambda e: (c[e], -e))", "lambda e: (c[e], e))", "static_hot: a tie keeps the hot set"),
    (L, "return (1, 0, rec.last_use, e)", "return (1, 0, -rec.last_use, e)", "lease: free experts LRU first"),
    (L, "return (0, 0, -1, e)", "return (4, 0, -1, e)", "lease: untracked first"),
    (L, "return (3, 0 if rec.preemptible else 1,", "return (3, 1 if rec.preemptible else 0,",
     "lease: pre-emptible before long leases"),
    (L, "gte if gte is not None else -1,", "-gte if gte is not None else -1,", "lease: earliest grace end first"),
    (L, "                self._grant(layer, e, clock, 0.0, prefetched=True)", "                pass",
     "lease: issued prefetches hold a lease"),
    (C, "            self.mover.record_read(layer)\n        self._flush()", "            self.mover.record_read(layer)",
     "cache: on_access delivered at release"),
    (C, "        self._pending.append((layer, list(chunk), clock))  # on_access",
     "        self.policy.on_access(layer, list(chunk), clock)  # on_access", "cache: on_access after the kernel"),
]


def copy_and_test(tmp: str, name: str, fname: str | None = None, old: str = "", new: str = "") -> bool | None:
    """Copy the package, apply one mutation (none when ``fname`` is None), run the contract tests: passed?
    None when the original text is not found exactly once."""
    pkg = Path(tmp) / name
    shutil.copytree(ROOT / "harness", pkg / "harness",
                    ignore=shutil.ignore_patterns("checkpoints", "bundled", "__pycache__", "*.pt", "*.safetensors"))
    if fname is not None:
        target = pkg / "harness" / "techniques" / "offload" / fname
        text = target.read_text()
        if text.count(old) != 1:
            return None
        target.write_text(text.replace(old, new))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", str(TESTS)],
                          cwd=pkg, env={**os.environ, "PYTHONPATH": str(pkg)}, capture_output=True, text=True)
    return proc.returncode == 0


def main() -> int:
    survivors = []
    with tempfile.TemporaryDirectory() as tmp:
        if not copy_and_test(tmp, "baseline"):
            print("the unmutated copy fails the contract tests: nothing to learn from the mutants")
            return 2
        only = sys.argv[1:]  # optional: rule substrings to run (e.g. "lease:" or "oracle: only decode")
        for i, (fname, old, new, rule) in enumerate(MUTANTS):
            if only and not any(o in rule for o in only):
                continue
            passed = copy_and_test(tmp, f"m{i}", fname, old, new)
            if passed is None:
                print(f"mutant {i} ({rule}): the original text is not found once in {fname}")
                survivors.append(rule)
                continue
            killed = not passed
            print(f"{'killed  ' if killed else 'SURVIVED'} {fname:12s} {rule}", flush=True)
            if not killed:
                survivors.append(rule)
    print(f"{len(survivors)} mutant(s) survived: {survivors}" if survivors else "every mutant run was killed")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
