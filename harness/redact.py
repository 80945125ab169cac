"""Masking secrets before they reach a file the harness writes (logs, recorded commands).

Why (issue 26): the ``vllm serve`` launcher wrote every ``HARNESS_*`` variable into ``<run_dir>/vllm_serve.log``,
``HARNESS_SLURM_SETUP`` included, whose ``export HF_TOKEN=…`` lines then sat in a run directory that is copied,
shared and uploaded as a W&B artifact. The rule here is deliberately blunt, because a leaked token costs more
than a masked harmless value: a variable whose *name* looks like a secret (``TOKEN``, ``KEY``, ``SECRET``,
``PASSWORD``/``PASSWD``, ``AUTH``, ``CREDENTIAL``, in any case) has its value replaced by ``***``; in a shell
setup string every ``export NAME=value`` (and any secret-looking ``NAME=value``) keeps only its name; a
command line's ``--api-key X`` / ``--hf-token=X`` style flags (a name *ending* in key, token, secret, password,
credential(s), or holding auth) keep only the flag. Only the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

MASK = "***"
_SECRET = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|AUTH|CREDENTIAL", re.IGNORECASE)
# flags are named more precisely than variables: ``--tokenizer`` and ``--max-num-batched-tokens`` are no secrets
_SECRET_FLAG = re.compile(r"(key|token|secret|passw(or)?d|credentials?)$|auth", re.IGNORECASE)
#: shell variables whose value is a setup script (``;``-separated commands) rather than a value
SETUP_VARIABLES = frozenset({"HARNESS_SLURM_SETUP"})
# ``export A=1 B=2`` and bare ``NAME=value``: the value is a quoted string or runs to whitespace or ``;``
_VALUE = r"(?:\"(?:[^\"\\]|\\.)*\"|'[^']*'|[^\s;'\"]+)*"
_EXPORT = re.compile(r"\bexport((?:\s+[A-Za-z_][A-Za-z0-9_]*(?:=" + _VALUE + ")?)+)")
_ASSIGN = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(" + _VALUE + ")")


def is_secret_name(name: str) -> bool:
    """Whether a variable or flag name looks like it holds a secret (module doc)."""
    return bool(_SECRET.search(name))


def mask_setup(script: str) -> str:
    """A shell setup string with every exported value, and every secret-looking assignment, masked."""
    def export(m: re.Match[str]) -> str:
        return "export" + _ASSIGN.sub(lambda a: f"{a.group(1)}={MASK}", m.group(1))

    script = _EXPORT.sub(export, script)
    return _ASSIGN.sub(lambda a: f"{a.group(1)}={MASK}" if is_secret_name(a.group(1)) else a.group(0), script)


def mask_value(name: str, value: str) -> str:
    """``value`` as it may be written next to ``name`` in a log."""
    if is_secret_name(name):
        return MASK
    if name in SETUP_VARIABLES:
        return mask_setup(value)
    return value


def mask_env(env: Mapping[str, str], names: Iterable[str] | None = None) -> dict[str, str]:
    """``{name: masked value}`` for ``names`` (default: every variable of ``env``), sorted by name."""
    keys = sorted(env if names is None else (n for n in names if n in env))
    return {k: mask_value(k, env[k]) for k in keys}


def mask_argv(argv: Iterable[str]) -> list[str]:
    """A command line with the values of secret-looking flags (``--api-key X``, ``--hf-token=X``) masked."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(MASK)
            hide_next = False
        elif arg.startswith("--") and "=" in arg and _SECRET_FLAG.search(arg.split("=", 1)[0]):
            out.append(arg.split("=", 1)[0] + "=" + MASK)
        else:
            out.append(arg)
            hide_next = arg.startswith("--") and bool(_SECRET_FLAG.search(arg))
    return out
