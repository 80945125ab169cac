"""Files (and scorer models) the run reads, checked before the model loads (issue 26; docs/validation.md "Files").

``RULES`` in validate.py only ask whether a path names an existing file. Here each file is read the way the
run will read it (the same loader), and its content is checked: a truncated or corrupt safetensors/torch file,
a wrong tensor shape, a JSON file that is not JSON, a scorer model nobody can load. Found after the model
loaded, these ended in ``KeyError`` / ``EOFError`` / safetensors errors that named neither key nor file, or
(``scoring.clip_model=NoSuchClip-99``) in every sample's score being an error. Two passes, like validate.py's:

1. :func:`validate_files` — :data:`FILE_RULES`, each file alone (right after ``validate_config``);
2. :func:`validate_model_files` — the same files against the numbers the checkpoint's ``config.json`` decides
   (experts per layer), right after ``validate_model`` and before any weight loads.

A refusal is one line, :class:`~harness.config.checks.ConfigError` (exit code 2):
``sere.similarity='/p/sim.safetensors' is not allowed: expected <what the file must be>; this file: <what is
wrong>``. Reading a file is memoised on (path, mtime, size), so the second pass does not read it again.
Only the standard library is imported at module level (torch, safetensors, open_clip inside the checks).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from harness.config.checks import _select, _sere_on, ConfigError, FileRule, _MISSING
from harness.metrics.scoring import clip_backend, TRANSFORMERS_PREFIX
from harness.run.rules_offload import _offload_on


def _short(exc: BaseException) -> str:
    """``Type: first line of the message`` (a loader's traceback text in one line)."""
    first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    if len(first) > 120 and ". " in first:  # a loader's advice after its first sentence (torch's zip reader)
        first = first.split(". ", 1)[0]
    return f"{type(exc).__name__}: {first[:200]}" if first else type(exc).__name__


def _stamp(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.realpath(path), st.st_mtime_ns, st.st_size


class _Bad(Exception):
    """What is wrong with a file (the text after ``this file:``)."""


# ------------------------------------------------------------------------------------------- SERE artifacts


@functools.lru_cache(maxsize=8)
def _similarity(stamp: tuple[str, int, int]) -> dict[int, Any]:
    from harness.techniques.sere.calibration import load_similarity

    try:
        sims, _ = load_similarity(stamp[0])
    except Exception as e:  # noqa: BLE001 - any loader failure is the file's fault, said in one line
        raise _Bad(f"not a readable SERE similarity file ({_short(e)})") from None
    return sims


def _square_matrices(sims: dict[int, Any]) -> str | None:
    import torch

    sizes = set()
    for layer, m in sims.items():
        if layer < 0:
            return f"layer {layer} is negative"
        if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] < 2:
            return f"layer {layer}'s matrix has shape {list(m.shape)}, not [E, E] with E >= 2"
        if not bool(torch.isfinite(m).all()):
            return f"layer {layer}'s matrix has NaN or infinite entries"
        sizes.add(int(m.shape[0]))
    if len(sizes) > 1:
        return f"its layers have different expert counts {sorted(sizes)}"
    return None


def similarity_problem(path: str, cfg: Any) -> str | None:
    try:
        return _square_matrices(_similarity(_stamp(path)))
    except _Bad as e:
        return str(e)


def similarity_model_problem(path: str, cfg: Any, facts: Any) -> str | None:
    e = getattr(facts, "num_experts", None)
    sizes = {int(m.shape[0]) for m in _similarity(_stamp(path)).values()}
    if e is not None and sizes and sizes != {e}:
        got = min(sizes)
        return f"its matrices are {got} x {got}, the model has {e} experts per layer (calibrated for another model)"
    return None


@functools.lru_cache(maxsize=8)
def _protection(stamp: tuple[str, int, int], n: int | None) -> dict[int, Any]:
    from harness.techniques.sere.protection import load_protection

    try:
        prot, _ = load_protection(stamp[0], n=n)
    except Exception as e:  # noqa: BLE001
        raise _Bad(f"not a readable SERE protection file for sere.protect={n or 'as stored'} ({_short(e)})") from None
    return prot


def _n(cfg: Any) -> int | None:
    return int(_select(cfg, "sere.protect", 0) or 0) or None


def protection_problem(path: str, cfg: Any) -> str | None:
    try:
        prot = _protection(_stamp(path), _n(cfg))
    except _Bad as e:
        return str(e)
    sizes = set()
    for layer, v in prot.items():
        if layer < 0 or v.dim() != 1 or v.numel() < 1:
            return f"layer {layer}'s mask has shape {list(v.shape)}, not [E]"
        sizes.add(int(v.numel()))
    if len(sizes) > 1:
        return f"its layers have different expert counts {sorted(sizes)}"
    return None


def protection_model_problem(path: str, cfg: Any, facts: Any) -> str | None:
    e = getattr(facts, "num_experts", None)
    sizes = {int(v.numel()) for v in _protection(_stamp(path), _n(cfg)).values()}
    if e is not None and sizes and sizes != {e}:
        return f"its masks have {min(sizes)} experts per layer, the model has {e} (built for another model)"
    return None


# ------------------------------------------------------------------------------------------- offload files


@functools.lru_cache(maxsize=4)
def _trace(stamp: tuple[str, int, int]) -> Any:
    from harness.techniques.offload.trace_io import load_trace

    try:
        return load_trace(stamp[0])
    except KeyError as e:
        raise _Bad(f"not a routing trace: it has no {e} tensor (ids, weights, embeds, request, step, layers)") from None
    except Exception as e:  # noqa: BLE001
        raise _Bad(f"not a readable routing trace ({_short(e)})") from None


def _trace_pt(value: str) -> str:
    p = Path(value).expanduser()
    return str((p.with_suffix("") if p.suffix in (".pt", ".json") else p).with_suffix(".pt"))


def trace_problem(path: str, cfg: Any) -> str | None:
    try:
        trace = _trace(_stamp(_trace_pt(path)))
    except (_Bad, OSError) as e:
        return str(e) if isinstance(e, _Bad) else _short(e)
    if trace.ids.shape[0] == 0:
        return "it has no decode token (0 rows)"
    if int(trace.ids.min()) < -1:
        return f"it has expert id {int(trace.ids.min())} (ids are >= 0, or -1 for none)"
    if not bool((trace.weights == trace.weights).all()):
        return "its router weights have NaN entries"
    return None


def trace_model_problem(path: str, cfg: Any, facts: Any) -> str | None:
    e = getattr(facts, "num_experts", None)
    top = int(_trace(_stamp(_trace_pt(path))).ids.max())
    if e is not None and top >= e:
        return f"it names expert {top}, the model has {e} experts per layer (recorded on another model)"
    return None


def predictor_problem(path: str, cfg: Any) -> str | None:
    from harness.techniques.offload.predictor import load_predictor

    try:
        load_predictor(path)
    except KeyError as e:
        return f"not a stability predictor: it has no {e} entry (spec, state_dict)"
    except Exception as e:  # noqa: BLE001
        return f"not a readable stability predictor ({_short(e)})"
    return None


def resident_summary_problem(path: str, cfg: Any) -> str | None:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte {e.start})"
    except json.JSONDecodeError as e:
        return f"not JSON (line {e.lineno}, column {e.colno}: {e.msg})"
    except OSError as e:
        return _short(e)
    block = data.get("offload") if isinstance(data, dict) else None
    if not isinstance(block, dict):
        return "it has no offload block (a summary.json of a run with offload.policy=none has one)"
    if block.get("policy") != "none":
        return f"its offload.policy is {block.get('policy')!r}, not 'none'"
    tps = block.get("tokens_per_s")
    if not (isinstance(tps, (int, float)) and not isinstance(tps, bool) and math.isfinite(tps) and tps > 0):
        return f"its offload.tokens_per_s is {tps!r}, not a number > 0"
    return None


# --------------------------------------------------------------------------------------- scorer models


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _model_dir_or_hub(value: str, what: str) -> str | None:
    """A local directory with ``config.json``, or a hub id (``org/name``) — in the hub cache when offline."""
    p = Path(value).expanduser()
    if p.is_dir():
        return None if (p / "config.json").is_file() else f"the directory {p} has no config.json (not a {what})"
    if p.exists():
        return f"{p} is a file, not a {what} directory or hub id"
    if not _HUB_ID.fullmatch(value):
        return f"neither a directory nor a hub id org/name ({value!r} does not exist here)"
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        try:
            from huggingface_hub import try_to_load_from_cache

            if not isinstance(try_to_load_from_cache(value, "config.json"), str):
                return f"the hub id {value} is not in the hub cache and HF_HUB_OFFLINE=1"
        except Exception:  # noqa: BLE001 - no hub client: the load will say
            return None
    return None


def clip_model_problem(value: str, cfg: Any) -> str | None:
    name = str(value)
    if name == "tiny":
        return None
    if clip_backend(name) == "transformers":
        return _model_dir_or_hub(name.removeprefix(TRANSFORMERS_PREFIX), "transformers CLIP model")
    import importlib.util

    if importlib.util.find_spec("open_clip") is None:
        return None  # rules_cross.py's CORE_CROSS_RULES refuse it, naming the [clip] extra
    if name.startswith("hf-hub:"):
        return None if _HUB_ID.fullmatch(name[len("hf-hub:"):]) else "hf-hub: needs a hub id org/name"
    if name.startswith("local-dir:"):
        d = Path(name[len("local-dir:"):]).expanduser()
        return None if (d / "open_clip_config.json").is_file() else f"{d} has no open_clip_config.json"
    import open_clip

    known = open_clip.list_models()
    if name not in known:
        near = [m for m in known if m.lower().startswith(name.lower()[:4])][:5] or known[:5]
        return (f"not a model open_clip knows (it has {len(known)}, e.g. {', '.join(near)}); or tiny, "
                "transformers:<repo or dir>, hf-hub:<org/name>, local-dir:<dir>")
    pretrained = _select(cfg, "scoring.clip_pretrained", None)
    if pretrained and not Path(str(pretrained)).expanduser().is_file():
        tags = open_clip.list_pretrained_tags_by_model(name)
        if str(pretrained) not in tags:
            return (f"scoring.clip_pretrained={pretrained!r} is neither a file nor a tag of {name} "
                    f"({', '.join(tags) or 'it has none'})")
    return None


def embed_model_problem(value: str, cfg: Any) -> str | None:
    return None if str(value) == "tiny" else _model_dir_or_hub(str(value), "text embedding model")


def stopwords_problem(value: str, cfg: Any) -> str | None:
    if value in ("public", "project", "none"):
        return None
    try:
        Path(value).expanduser().read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 text (byte {e.start}); a stopword list is one word per line"
    except OSError as e:
        return _short(e)
    return None


# ------------------------------------------------------------------------------------------------- table


def _lease_predictor(cfg: Any) -> bool:
    return _offload_on(cfg) and cfg.offload.policy == "lease" and _select(cfg, "offload.lease.score", None) == "predictor"


FILE_RULES: tuple[FileRule, ...] = (
    FileRule("sere.similarity", "a SERE similarity file (safetensors, one finite [E, E] matrix per MoE layer; "
             "python -m harness.commands.sere_calibrate writes one)", similarity_problem, _sere_on,
             similarity_model_problem),
    FileRule("sere.protection", "a SERE protection file (safetensors, one [E] mask per MoE layer; "
             "python -m harness.commands.sere_protect writes one)", protection_problem, _sere_on,
             protection_model_problem),
    FileRule("offload.trace", "a routing trace NAME.pt + NAME.json (offload.policy=none offload.record_trace=NAME "
             "records one)", trace_problem, _offload_on, trace_model_problem),
    FileRule("offload.lease.predictor", "a stability predictor NAME.pt (python -m harness.techniques.offload."
             "predictor train TRACE --out NAME writes one)", predictor_problem, _lease_predictor),
    FileRule("offload.resident_summary", "the summary.json of a finished offload.policy=none run",
             resident_summary_problem, _offload_on),
    FileRule("scoring.clip_model", "a CLIP model the scorer can load", clip_model_problem),
    FileRule("scoring.embed_model", "a text embedding model the scorer can load", embed_model_problem),
    FileRule("scoring.stopwords", "public, project, none or a UTF-8 stopword list", stopwords_problem),
)


def _refusal(rule: FileRule, value: Any, problem: str) -> ConfigError:
    return ConfigError(f"{rule.key}={str(value)!r} is not allowed: expected {rule.what}; this file: {problem}"
                       if rule.key not in ("scoring.clip_model", "scoring.embed_model") else
                       f"{rule.key}={str(value)!r} is not allowed: expected {rule.what}; {problem}")


def _applicable(cfg: Any):
    for rule in FILE_RULES:
        value = _select(cfg, rule.key)
        if value is _MISSING or value is None or (rule.when is not None and not rule.when(cfg)):
            continue
        yield rule, str(value)


def validate_files(cfg: Any) -> None:
    """Read every file :data:`FILE_RULES` names (those the run will read) and refuse a bad one, before the
    model loads."""
    for rule, value in _applicable(cfg):
        problem = rule.problem(os.path.expanduser(value), cfg)
        if problem is not None:
            raise _refusal(rule, value, problem)


def validate_model_files(cfg: Any, facts: Any) -> None:
    """The files against the checkpoint's numbers (:class:`harness.run.rules_model.ModelFacts`), before weights
    load. Call after :func:`validate_files` (a file that failed there never reaches here)."""
    if facts is None:
        return
    for rule, value in _applicable(cfg):
        if rule.model_problem is not None:
            problem = rule.model_problem(os.path.expanduser(value), cfg, facts)
            if problem is not None:
                raise _refusal(rule, value, problem)
