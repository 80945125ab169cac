"""RAG-IGBench: multimodal answers with images placed in the text (arXiv 2512.05119).

Rows are the released JSON Lines (``RAG_IG_CH.jsonl``; the English file is JSON Lines too despite its
``.json`` name): ``id, query, documents, images, gt_raw_answer, gt_clean_answer, category, split``. Older
releases name the answer ``gt_answer`` and have no ``split``; both are read. ``images`` is a list per note
of image URLs (the README's schema) or of ``{"imgList": [...]}`` objects (what the upstream generation
scripts read); both are accepted.

Images: an entry that is a relative path is resolved under the image root (default: the data file's
folder); a URL is mapped to ``<image_root>/<sha1(url)[:20]><ext>``, the file that
``python -m harness.datasets.prepare rag_igbench`` downloads. Either way the path cannot leave the root.

The prompt is the benchmark's own template (``prompts/rag_igbench_zh.jinja``, from the upstream
``model_generation/prompt.py``), rendered the way the upstream Qwen2-VL script renders it: each note's
image list is the Python ``repr`` of ``"(IMG#k) <img>url</img>\\n"`` strings, and the text is then split at
the ``<img>`` tags into text and image parts (each text part stripped). Keeping that quirk keeps our
prompts identical to the ones behind the published numbers. ``language=en`` uses our own English
rendering of the same instructions.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from harness.datasets._io import config_key, data_path, image_root_of, iter_json_rows
from harness.datasets.base import DatasetError, ImageInput, PathEscapeError, Sample, resolve_under
from harness.datasets.faults import (
    RowFault,
    UniqueIds,
    data_error_sample,
    id_field,
    list_field,
    string_items,
    text_field,
)

PROMPTS = Path(__file__).parent / "prompts"
_IMG_TAG = re.compile(r"<img>(.*?)</img>", re.DOTALL)


def url_to_filename(url: str) -> str:
    """Deterministic local file name of an image URL (shared with the ``prepare`` downloader)."""
    ext = Path(url.split("?", 1)[0]).suffix.lower()
    if ext not in {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp"}:
        ext = ".jpg"
    return hashlib.sha1(url.encode("utf-8")).hexdigest()[:20] + ext


def note_images(entry: Any, note: int = 0) -> list[str]:
    """The image references of one note, whichever of the two upstream shapes it has (a list of URLs or
    ``{"imgList": [...]}``); anything else is a ``wrong_type`` :class:`RowFault` (never coerced)."""
    key = f"images[{note}]"
    if isinstance(entry, dict):
        if "imgList" not in entry:
            raise RowFault("missing_field", f"field {key!r} is an object without 'imgList'")
        entry, key = entry["imgList"], f"{key}.imgList"
    if not isinstance(entry, list):
        kind = "null" if entry is None else type(entry).__name__
        raise RowFault("wrong_type", f"field {key!r} must be a list of image URLs, got {kind}")
    return string_items(entry, key)


def iter_rows(path: Path, key: str = "dataset.path") -> Iterator[tuple[int, Any]]:
    """Stream (line number, row) from a JSON Lines file; a JSON array file is read whole."""
    for _, lineno, row in iter_json_rows(path, key):
        yield lineno, row


def render_prompt(query: str, documents: list[str], refs: list[list[str]], language: str = "zh") -> list[dict]:
    """The benchmark's prompt as ordered content parts; image parts carry their global 0-based index."""
    from jinja2 import Template

    template = Template((PROMPTS / f"rag_igbench_{language}.jinja").read_text(encoding="utf-8"))
    lists, k = [], 0
    for note in refs:
        entries = []
        for _ in note:
            k += 1
            entries.append(f"(IMG#{k}) <img>{k - 1}</img>\n")
        lists.append(entries)
    notes = [{"doc": doc, "img": img} for doc, img in zip(documents, lists)]
    text = template.render(query=query, notes=notes)
    content: list[dict] = []
    for i, part in enumerate(_IMG_TAG.split(text)):
        if i % 2 == 0:
            if part.strip():
                content.append({"type": "text", "text": part.strip()})
        else:
            content.append({"type": "image", "index": int(part)})
    return content


def _image_input(ref: str, image_root: Path) -> ImageInput:
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", ref):
        return ImageInput(source="rag_igbench", path=image_root / url_to_filename(ref), key=ref)
    try:
        return ImageInput(source="rag_igbench", path=resolve_under(image_root, ref), key=ref)
    except PathEscapeError as e:
        raise RowFault("bad_image_path", str(e)) from e


def reference_answer(row: dict) -> str:
    """``gt_clean_answer`` (current releases) or ``gt_answer`` (older ones), a non-empty string."""
    key = "gt_clean_answer" if row.get("gt_clean_answer") is not None or "gt_answer" not in row else "gt_answer"
    if key not in row:
        raise RowFault("missing_field", "has neither 'gt_clean_answer' nor 'gt_answer'")
    return text_field(row, key)


def row_to_sample(row: Any, image_root: Path, language: str, dataset: str) -> Sample:
    """One row → one sample, checked against the upstream schema; any defect is a :class:`RowFault`.

    ``documents`` a list of strings, ``images`` a list of image lists aligned with it (one per note: a note
    without images has ``[]``), ``query`` and the reference answer non-empty strings, ``id`` an integer or a
    string, every image a URL or a path inside the image root. A reference that places an ``IMG#k`` outside
    1..candidates is *not* refused here: the scorer flags it (``reference_fault``, counted in
    ``metrics.data_errors``) and scores it as the public scorer does or, with
    ``scoring.reference_faults=error``, as an error (``harness.metrics.rag_igbench.score_sample``)."""
    if not isinstance(row, dict):
        raise RowFault("not_an_object", f"row is a JSON {type(row).__name__ if row is not None else 'null'}, "
                                        "not an object")
    uid = id_field(row, "id")
    query = text_field(row, "query")
    documents = string_items(list_field(row, "documents"), "documents")
    notes = list_field(row, "images", allow_empty=True)
    refs = [note_images(entry, i) for i, entry in enumerate(notes)]
    if len(refs) != len(documents):
        raise RowFault("documents_images_mismatch",
                       f"{len(documents)} documents but {len(refs)} image lists (one list per document, [] for a "
                       "document without images)")
    answer = reference_answer(row)
    if row.get("split") is not None:
        text_field(row, "split")
    n_candidates = sum(len(n) for n in refs)
    images = [_image_input(ref, image_root) for note in refs for ref in note]
    return Sample(
        uid=uid,
        dataset=dataset,
        task="rag_igbench",
        content=render_prompt(query, documents, refs, language),
        images=images,
        reference={"answer": answer, "n_candidates": n_candidates},
        meta={"query": query, "category": row.get("category"), "split": row.get("split")},
    )


def load(cfg, root: Path) -> Iterator[Sample]:
    """Samples of a RAG-IGBench file, filtered by ``split`` and cut at ``limit`` (streamed).

    A defective row becomes a data-error sample (:mod:`harness.datasets.faults`) with its file, line and
    reason; a defective file stops with a :class:`DatasetError`. A repeated ``id`` is a ``duplicate_id``
    fault of the later row (uid ``id#k``)."""
    path = data_path(cfg, root, file_only=True)
    image_root = image_root_of(cfg, root, path.parent)
    ids = UniqueIds()
    n, other_splits = 0, set()
    for lineno, row in iter_rows(path, config_key(cfg, "path")):
        if cfg.limit is not None and n >= cfg.limit:
            return
        if cfg.split and isinstance(row, dict) and isinstance(row.get("split", cfg.split), str) and \
                row.get("split", cfg.split) != cfg.split:
            other_splits.add(row["split"])
            continue
        where = f"{path}:{lineno}"
        raw_id = row.get("id") if isinstance(row, dict) else None
        uid = str(raw_id) if isinstance(raw_id, (int, str)) and not isinstance(raw_id, bool) and str(raw_id) \
            else f"line{lineno}"
        uid, taken = ids.claim(uid)
        try:
            if taken:
                raise RowFault("duplicate_id", f"id {raw_id!r} is used by an earlier row (ids key results)")
            sample = row_to_sample(row, image_root, cfg.language, cfg.name)
            sample.uid = uid
        except RowFault as fault:
            sample = data_error_sample(uid, cfg.name, "rag_igbench", f"{where} (id={raw_id!r})", fault,
                                       reference={"answer": None, "n_candidates": None},
                                       meta={"split": row.get("split") if isinstance(row, dict) else None})
        n += 1
        yield sample
    if n == 0 and other_splits:
        raise DatasetError(f"{path}: no row has split {cfg.split!r} (set by {config_key(cfg, 'split')}); "
                           f"the file's splits: {sorted(other_splits)}")
