"""Generation cache: finished generations keyed by what determines them, so a killed run (or sweep job) resumes.

A run looks every request up before generating; only misses go to the engine, and each generation is written
to the cache as soon as its batch returns. A rerun of a killed run therefore calls the model only for the
samples it had not finished, and replays the others.

**What the key covers** (:func:`key_for`, a SHA-256 over canonical JSON):

- the model (:func:`model_key`): the embedded model's spec fingerprint; for a local checkpoint its
  ``config.json`` bytes and the names and sizes of its weight files; for a hub id the id and, when the hub
  cache has it, the snapshot commit — plus the engine's identity (name, version, device type, dtype, batch
  size, attention and experts implementation: greedy outputs of bf16 kernels depend on them) and a hash of
  the harness code that generates (:func:`code_fingerprint`: engines, techniques, kernels, models, run.py);
- the request: its ordered content parts and a SHA-256 of every decoded image (mode, size, pixels), so a
  changed image file or a different image pre-processing is a different key;
- the generation parameters (``generation`` group, plus the seed when sampling);
- the technique settings (:func:`technique_settings`): a technique that is off (``visionzip.keep >= 1``,
  ``sere.k = null``) is ``None`` whatever its other fields say, so ``keep=1.0`` with scope ``request`` and
  ``image`` share their entries; artifact paths (SERE similarity / protection) add a hash of the file.

Scoring is not in the key: cached answers are re-scored on replay, so a scorer fix needs no regeneration.
Failed generations (``error`` set) are never cached (an OOM or a transient failure must be retried).

**When the cache is read** is the run's decision (``cache.read``, see ``harness/run/experiment.py``): by default only
when a run directory is re-entered after an interrupted attempt (resume), never for a fresh run — a
latency harness must not silently replay answers into a new measurement.

**Latency is never taken from the cache.** A replayed generation has ``ttft_ms``/``tpot_ms``/``e2e_ms`` =
None; the run computes its latency distribution over the requests it generated and timed itself and says so in
``summary.json`` (``latency.partial``, ``latency.n_measured``, ``latency.n_cached``). The times measured when
the entry was written are kept in the entry (``measured``) for reference only. ``cache.read=false`` times
every request (the cache is still written).

**Storage: a directory of append-only JSON Lines shards**, one shard per writing process
(``<host>-<pid>-<random>.jsonl``), every line flushed and fsynced as it is written. Why not one SQLite file:
sweep jobs run concurrently on several Slurm nodes that share the results directory over NFS/Lustre, where
SQLite's locking (and WAL's shared memory) is not safe; a file per writer needs no locking at all, and a
process killed mid-line leaves a torn last line that readers skip. On open the shards are indexed (key →
shard, offset); :meth:`GenerationCache.get` reads one line. Only the standard library is imported here.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from harness.config.paths import open_new, resolve_user_path
from harness.engines.base import Generation
from harness.run.state import storage_error

CACHE_VERSION = 1

# Generation fields stored and replayed (timings are stored apart, under "measured", and never replayed).
_REPLAYED = ("text", "prompt_tokens", "visual_tokens", "output_tokens")
_TIMINGS = ("ttft_ms", "tpot_ms", "e2e_ms")


# ------------------------------------------------------------------------------------------------ key parts


def _plain(value: Any) -> Any:
    """DictConfig / dataclass / mapping / sequence → plain JSON-able Python (keys as strings)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return _plain(OmegaConf.to_container(value, resolve=True))
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _canonical(obj: Any) -> str:
    return json.dumps(_plain(obj), sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def image_digest(image: Any) -> str:
    """SHA-256 of a decoded image (PIL: mode, size and pixels; bytes: the bytes; else its repr)."""
    h = hashlib.sha256()
    if hasattr(image, "tobytes") and hasattr(image, "size"):
        h.update(f"{getattr(image, 'mode', '')}|{tuple(image.size)}|".encode())
        h.update(image.tobytes())
    elif isinstance(image, (bytes, bytearray, memoryview)):
        h.update(bytes(image))
    else:
        h.update(repr(image).encode())
    return h.hexdigest()


def request_fingerprint(request: Any) -> dict[str, Any]:
    """What the engine sees of a request: its content parts and the digests of its images (not the uid)."""
    content = request.content if hasattr(request, "content") else request["content"]
    images = request.images if hasattr(request, "images") else request.get("images", [])
    return {"content": _plain(content), "images": [image_digest(im) for im in images]}


def _file_digest(path: str | None) -> str | None:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        return None
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def technique_settings(techniques: Any) -> dict[str, Any]:
    """Normalised technique settings for the key: an off technique is None, whatever its other fields.

    ``techniques``: a mapping with (some of) ``visionzip`` and ``sere`` config blocks, e.g.
    ``{"visionzip": cfg.visionzip, "sere": cfg.sere}``; other entries (future techniques) are kept as given.
    """
    t = _plain(techniques) or {}
    out: dict[str, Any] = {}
    for name, block in sorted(t.items()):
        if name == "visionzip":
            out[name] = None if block is None or float(block.get("keep", 1.0)) >= 1.0 else block
            if out[name] is not None:  # issue 31's keys enter only where they change the output: old keys stay
                block = dict(block)
                if block.get("method", "attention") == "attention":
                    block.pop("method", None)
                if block.get("method") != "random":
                    block.pop("seed", None)
                out[name] = block
        elif name == "sere":
            if block is None or block.get("k") is None:
                out[name] = None
            else:
                block = dict(block)
                if int(block.get("protect") or 0) == 0 and not block.get("protection"):
                    block["protect"] = 0
                for art in ("similarity", "protection"):
                    if block.get(art):
                        block[f"{art}_sha256"] = _file_digest(block[art])
                out[name] = block
        else:
            out[name] = block
    return out


_ENGINE_KEYS = ("engine", "engine_version", "device", "dtype", "batch_size", "attn_implementation",
                "experts_implementation", "cuda_graphs", "tensor_parallel_size", "enforce_eager")


def engine_identity(engine_info: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of ``engine.describe()`` that can change a greedy output (device index and name dropped)."""
    ident = {k: engine_info.get(k) for k in _ENGINE_KEYS if k in engine_info}
    if isinstance(ident.get("device"), str):
        ident["device"] = ident["device"].split(":")[0]  # cuda:3 and cuda:0 give the same outputs
    return ident


def _hub_commit(repo_id: str) -> str | None:
    """The snapshot commit of a hub checkpoint in the local HF cache, when it is there (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover
        return None
    try:
        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # noqa: BLE001 - an unusual id must not stop the run
        return None
    if isinstance(found, str) and "/snapshots/" in found:
        return found.split("/snapshots/")[1].split("/")[0]
    return None


def model_fingerprint(model_info: Mapping[str, Any], model_path: str | None = None) -> str:
    """A short, stable identity of the weights (see the module docstring)."""
    if model_info.get("fingerprint"):
        return f"fp:{model_info['fingerprint']}"
    path = model_path or model_info.get("path") or model_info.get("name") or ""
    p = Path(path)
    if p.is_dir():
        h = hashlib.sha256()
        for name in ("config.json", "model.safetensors.index.json", "generation_config.json"):
            if (p / name).is_file():
                h.update(name.encode() + b"\0" + (p / name).read_bytes())
        for f in sorted(p.iterdir()):
            if f.suffix in {".safetensors", ".bin", ".pt", ".gguf"} and f.is_file():
                h.update(f"{f.name}:{f.stat().st_size}".encode())
        return f"dir:{h.hexdigest()[:16]}"
    commit = _hub_commit(path) if path else None
    return f"hub:{path}@{commit or 'unknown'}"


CODE_PARTS = ("engines", "techniques", "kernels", "models", "run/experiment.py", "__init__.py")


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """SHA-256 (first 16 hex digits) of the harness code that produces generations: ``harness/engines``,
    ``techniques``, ``kernels``, ``models``, ``run.py`` and the version. Editing a technique's implementation
    therefore invalidates its cached generations, even without a commit (the git commit alone would not see
    an edited working tree)."""
    pkg = Path(__file__).resolve().parents[1]  # harness/
    h = hashlib.sha256()
    for part in CODE_PARTS:
        target = pkg / part
        files = sorted(target.rglob("*.py")) if target.is_dir() else [target] if target.is_file() else []
        for f in files:
            h.update(str(f.relative_to(pkg)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def model_key(model_info: Mapping[str, Any], model_path: str | None, engine_info: Mapping[str, Any]) -> str:
    """The ``model_id`` argument of :func:`key_for`: weights fingerprint + engine identity + harness code."""
    return (f"{model_fingerprint(model_info, model_path)}|{_canonical(engine_identity(engine_info))}"
            f"|code:{code_fingerprint()}")


def key_for(model_id: str, request: Any, generation_cfg: Any, technique_cfg: Any) -> str:
    """The cache key of one request: SHA-256 over model, request content (+ image digests), generation
    parameters and normalised technique settings (``technique_cfg`` goes through
    :func:`technique_settings`)."""
    payload = {
        "v": CACHE_VERSION,
        "model": model_id,
        "request": request_fingerprint(request),
        "generation": _plain(generation_cfg),
        "techniques": technique_settings(technique_cfg),
    }
    return _sha256(_canonical(payload))


# ------------------------------------------------------------------------------------------------ entries


def generation_to_dict(gen: Any) -> dict[str, Any]:
    """A :class:`~harness.engines.base.Generation` (or a dict of its fields) → the stored entry."""
    d = dataclasses.asdict(gen) if dataclasses.is_dataclass(gen) else dict(gen)
    entry = {k: d.get(k) for k in _REPLAYED}
    entry["extra"] = json.loads(json.dumps(d.get("extra") or {}, default=str))  # JSON-safe copy
    entry["measured"] = {k: d.get(k) for k in _TIMINGS}  # reference only: never replayed as latency
    return entry


_TIME_SUFFIXES = ("_ms", "_us", "_ns", "_s", "_sec", "_seconds")


def _untimed(value: Any) -> Any:
    """``value`` with every entry whose key names a time (``*_ms``, ``*_s``, …) set to None, recursively:
    technique statistics in ``extra`` (e.g. VisionZip's ``importance_ms``) are replayed without their times."""
    if isinstance(value, dict):
        return {k: None if isinstance(k, str) and k.endswith(_TIME_SUFFIXES) else _untimed(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def generation_from_cache(entry: Mapping[str, Any], uid: str):
    """A stored entry → a :class:`~harness.engines.base.Generation` for ``uid`` with no timings: latency
    fields None, time-valued entries of ``extra`` None, ``extra["cached"] = True``."""
    return Generation(uid=uid, **{k: entry.get(k) for k in _REPLAYED},
                      ttft_ms=None, tpot_ms=None, e2e_ms=None, error=None,
                      extra={**_untimed(entry.get("extra") or {}), "cached": True})


def _count(v: Any) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def entry_problem(obj: Any, key: str | None = None) -> str | None:
    """Why a stored line is not a generation to replay (None: it is). Checked on read, so an entry with no
    ``gen``, a non-string ``gen.text``, negative or non-integer token counts, or another format version is
    skipped and regenerated — before, it was replayed as the answer or crashed the run."""
    if not isinstance(obj, dict):
        return "not a JSON object"
    if key is not None and obj.get("key") != key:
        return "another key at this offset"
    if obj.get("v") != CACHE_VERSION:
        return f"format version {obj.get('v')!r}, this harness writes {CACHE_VERSION}"
    gen = obj.get("gen")
    if not isinstance(gen, dict):
        return "no gen object"
    if not isinstance(gen.get("text"), str):
        return f"gen.text is {type(gen.get('text')).__name__}, not a string"
    for k in ("prompt_tokens", "visual_tokens", "output_tokens"):
        if not _count(gen.get(k)):
            return f"gen.{k} is {gen.get(k)!r}, not a count"
    for k in ("extra", "measured"):
        if gen.get(k) is not None and not isinstance(gen.get(k), dict):
            return f"gen.{k} is not an object"
    return None


# ------------------------------------------------------------------------------------------------ the store


class GenerationCache:
    """A directory of append-only JSONL shards. ``get`` / ``put`` by key; safe for concurrent writers.

    ``read=False``: nothing is looked up (every request is generated and timed), entries are still written.
    """

    def __init__(self, path: str | os.PathLike, *, read: bool = True):
        # like dataset paths: ``~`` expanded, relative to the directory the command was typed in; the default
        # (``${harness_cache:generations}``) is absolute, so a rerun from anywhere finds the same entries
        self.path = resolve_user_path(path)
        if self.path.suffix in {".sqlite", ".db", ".jsonl"}:
            raise ValueError(f"cache.path={path!s}: the generation cache is a directory of shards, not a file")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise storage_error(e, self.path, "cache.path") from e
        self.read = read
        self.hits = self.misses = self.written = self.skipped_lines = 0
        self.invalid_lines = 0  # lines with a key whose entry is not a valid generation (never replayed)
        self.invalid_skipped: dict[str, int] = {}  # looked up, found only invalid: regenerated (reason -> count)
        self._index: dict[str, tuple[Path, int]] = {}
        self._bad: dict[str, str] = {}  # key -> why its only entries are invalid
        self._shard: Path | None = None
        self._f = None
        if read:
            for shard in sorted(self.path.glob("*.jsonl")):
                self._index_shard(shard)

    # -- reading
    def _index_shard(self, shard: Path) -> None:
        try:  # a shard is a regular file of the cache directory, never read through a link
            fd = os.open(shard, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        except OSError:
            self.skipped_lines += 1
            return
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self.skipped_lines += 1
            return
        with os.fdopen(fd, "rb") as f:
            offset = 0
            for line in f:
                if not line.endswith(b"\n"):  # a writer killed mid-line: the torn tail is not an entry
                    self.skipped_lines += 1
                    break
                try:
                    obj = json.loads(line)
                    key = obj["key"]
                    if not isinstance(key, str):
                        raise TypeError(key)
                except (ValueError, KeyError, TypeError):
                    self.skipped_lines += 1
                else:
                    problem = entry_problem(obj)
                    if problem is None:
                        self._index.setdefault(key, (shard, offset))
                    else:  # a later valid entry of the same key (the regenerated one) is the one replayed
                        self.invalid_lines += 1
                        self._bad.setdefault(key, problem)
                offset += len(line)

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored generation for ``key`` (see :func:`generation_to_dict`), or None."""
        where = self._index.get(key) if self.read else None
        if where is None:
            if self.read and key in self._bad:
                self._skip(key, self._bad[key])
            self.misses += 1
            return None
        shard, offset = where
        if shard == self._shard and self._f is not None:
            self._f.flush()
        try:  # re-read and re-checked: the shard may have changed since it was indexed
            with open(shard, "rb") as f:
                f.seek(offset)
                entry = json.loads(f.readline())
            problem = entry_problem(entry, key)
        except (OSError, ValueError) as e:
            problem = f"unreadable ({type(e).__name__})"
        if problem is not None:
            del self._index[key]
            self._skip(key, problem)
            self.misses += 1
            return None
        self.hits += 1
        return entry["gen"]

    def _skip(self, key: str, problem: str) -> None:
        """An invalid entry looked up: counted (``summary.json`` ``cache.invalid_skipped``), logged, regenerated."""
        import logging

        self.invalid_skipped[problem] = self.invalid_skipped.get(problem, 0) + 1
        logging.getLogger(__name__).warning("generation cache %s: entry %s… skipped (%s); it is regenerated",
                                            self.path, key[:12], problem)

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def __bool__(self) -> bool:  # an empty cache is still a cache (``if cache:`` must not mean "has entries")
        return True

    # -- writing
    def _open_shard(self) -> None:
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
        self._shard = self.path / name
        try:  # a new file, never through a link (O_EXCL | O_NOFOLLOW)
            self._f = os.fdopen(open_new(self._shard, 0o644, append=True), "ab")
        except OSError as e:
            raise storage_error(e, self.path, "cache.path") from e

    def put(self, key: str, generation: Any) -> None:
        """Append one finished generation (a Generation or a dict of its fields), flushed and fsynced.
        Generations with ``error`` set are not stored."""
        entry = generation if isinstance(generation, Mapping) and "measured" in generation \
            else generation_to_dict(generation)
        err = getattr(generation, "error", None) if not isinstance(generation, Mapping) else generation.get("error")
        if err:
            return
        if self._f is None:
            self._open_shard()
        offset = self._f.tell()
        line = json.dumps({"key": key, "v": CACHE_VERSION, "gen": entry}, ensure_ascii=False) + "\n"
        try:
            self._f.write(line.encode("utf-8"))
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:  # a full disk: drop the torn line, keep every entry before it, stop with one line
            f, self._f = self._f, None
            for undo in (f.close, lambda: os.truncate(self._shard, offset)):
                try:
                    undo()
                except OSError:
                    pass
            raise storage_error(e, self._shard, "cache.path", resume=f"the {self.written} generations already "
                                f"in {self.path} are replayed, not generated again") from e
        self._index[key] = (self._shard, offset)
        self._bad.pop(key, None)
        self.written += 1

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def __enter__(self) -> GenerationCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        """For ``summary.json["cache"]``."""
        return {"path": str(self.path), "read": self.read, "entries": len(self._index), "hits": self.hits,
                "misses": self.misses, "written": self.written, "skipped_lines": self.skipped_lines,
                "invalid_lines": self.invalid_lines, "invalid_skipped": sum(self.invalid_skipped.values()),
                "invalid_reasons": dict(self.invalid_skipped)}


def keys_for_requests(model_id: str, requests: Iterable[Any], generation_cfg: Any, technique_cfg: Any) -> list[str]:
    """:func:`key_for` over many requests (generation and technique parts serialised once)."""
    gen, tech = _plain(generation_cfg), technique_settings(technique_cfg)
    return [key_for(model_id, r, gen, tech) for r in requests]
