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

from harness.datasets._io import iter_json_rows
from harness.datasets.base import DatasetError, ImageInput, PathEscapeError, Sample, resolve_under

PROMPTS = Path(__file__).parent / "prompts"
REQUIRED = ("id", "query", "documents", "images")
_IMG_TAG = re.compile(r"<img>(.*?)</img>", re.DOTALL)


def url_to_filename(url: str) -> str:
    """Deterministic local file name of an image URL (shared with the ``prepare`` downloader)."""
    ext = Path(url.split("?", 1)[0]).suffix.lower()
    if ext not in {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp"}:
        ext = ".jpg"
    return hashlib.sha1(url.encode("utf-8")).hexdigest()[:20] + ext


def note_images(entry: Any) -> list[str]:
    """The image references of one note, whichever of the two upstream shapes it has."""
    if isinstance(entry, dict):
        entry = entry.get("imgList", [])
    if not isinstance(entry, list):
        raise TypeError(f"expected a list of image URLs, got {type(entry).__name__}")
    return [str(u) for u in entry]


def iter_rows(path: Path) -> Iterator[tuple[int, dict]]:
    """Stream (row number from 1, row) from a JSON Lines file; a JSON array file is read whole."""
    for pos, row in iter_json_rows(path):
        yield pos + 1, row


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
    return ImageInput(source="rag_igbench", path=resolve_under(image_root, ref), key=ref)


def row_to_sample(row: dict, where: str, image_root: Path, language: str, dataset: str) -> Sample:
    """One row → one sample; a missing required field is a :class:`DatasetError` naming it."""
    for key in REQUIRED:
        if key not in row:
            raise DatasetError(f"{where}: row id={row.get('id', '?')} has no field {key!r}")
    answer = row.get("gt_clean_answer", row.get("gt_answer"))
    if answer is None:
        raise DatasetError(f"{where}: row id={row['id']} has neither 'gt_clean_answer' nor 'gt_answer'")
    try:
        refs = [note_images(entry) for entry in row["images"]]
    except TypeError as e:
        raise DatasetError(f"{where}: row id={row['id']} field 'images': {e}") from e
    error = None
    images: list[ImageInput] = []
    try:
        images = [_image_input(ref, image_root) for note in refs for ref in note]
    except PathEscapeError as e:
        error = f"rejected image path: {e}"
    documents = [str(d) for d in row["documents"]]
    return Sample(
        uid=str(row["id"]),
        dataset=dataset,
        task="rag_igbench",
        content=render_prompt(str(row["query"]), documents, refs, language),
        images=images,
        reference={"answer": answer, "n_candidates": sum(len(n) for n in refs)},
        meta={"query": row["query"], "category": row.get("category"), "split": row.get("split")},
        error=error,
    )


def load(cfg, root: Path) -> Iterator[Sample]:
    """Samples of a RAG-IGBench file, filtered by ``split`` and cut at ``limit`` (streamed)."""
    path = Path(cfg.path)
    path = path if path.is_absolute() else root / path
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path} (set by dataset.path)")
    image_root = Path(cfg.image_root) if cfg.image_root else path.parent
    image_root = image_root if image_root.is_absolute() else root / image_root
    if not image_root.is_dir():
        raise DatasetError(f"image root not found: {image_root} (set by dataset.image_root)")
    seen: dict[str, int] = {}
    n = 0
    for lineno, row in iter_rows(path):
        if cfg.limit is not None and n >= cfg.limit:
            return
        if not isinstance(row, dict):
            raise DatasetError(f"{path}: line {lineno} is not a JSON object")
        if cfg.split and row.get("split", cfg.split) != cfg.split:
            continue
        sample = row_to_sample(row, f"{path}:{lineno}", image_root, cfg.language, cfg.name)
        count = seen.get(sample.uid, 0)
        seen[sample.uid] = count + 1
        if count:  # ids must key results and caches: never let two rows share one
            sample.uid = f"{sample.uid}#{count}"
        n += 1
        yield sample
