"""CCBench (MMBench family, Chinese culture): multiple choice over a VLMEvalKit TSV, with circular evaluation.

TSV columns: ``index, image`` (base64), ``question, A, B, C, D`` (missing options are empty fields),
``answer`` (a letter), ``category``; MMBench-family files may add ``hint``, ``l2-category``, ``split``,
``comment``, ``source``. Any other MMBench-format TSV (``MMBench_DEV_CN.tsv``...) reads the same way.

Circular evaluation (MMBench): a question with N options is asked N times with the options rotated and
counts only if every rotation is answered right. Rotation ``r`` puts the original option ``(j + r) mod N``
at letter ``j`` (ABCD → BCDA → CDAB → DABC), so the gold letter moves from ``g`` to ``(g − r) mod N``.

* When the file holds only originals, the rotations are generated; rotation ``r`` of question ``i`` gets
  the uid ``i + r·1,000,000`` — the index VLMEvalKit gives such a row.
* When the file already holds rotated rows (``index ≥ 1,000,000``), they are used as they are, grouped by
  ``index % 1,000,000``; their ``image`` field may hold just the main row's index (VLMEvalKit's rule: a
  field of at most 64 characters), which is resolved to that row's image. The decision is per question, so
  a file where only some questions carry rotations still gives every question its N rotations.
* ``circular: false`` asks each question once (rotation 0 only).

``limit`` counts questions, not rows, so that a question is never cut off from some of its rotations.

Prompt (VLMEvalKit ``Qwen2VLPromptMixin._build_mcq_prompt``, the prompt VLMEvalKit uses for the Qwen-VL
family this project evaluates): the image, then ``[Hint: …\\n]Question: …\\nOptions:\\nA. …\\nB. …\\n`` and
``请直接回答选项字母。`` (``Please select the correct answer from the options above.`` when the prompt has no
Chinese character). lmms-eval's ``mmbench_cn_cc`` task words it differently (``有如下几个选项：`` and
``请直接使用所提供的选项字母作为答案回答。``); see ``datasets/README.md``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from harness.datasets._io import blank, cfg_get, data_path, decode_b64, is_image_ref, iter_tsv
from harness.datasets.base import DatasetError, ImageInput, Sample

SOURCE = "ccbench"
ROTATION_STRIDE = 1_000_000
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
REQUIRED = ("index", "question", "answer", "image")
MCQ_CN_PROMPT = "请直接回答选项字母。"
MCQ_EN_PROMPT = "Please select the correct answer from the options above."
_CJK = re.compile("[\u4e00-\u9fff]")


def build_prompt(question: str, options: dict[str, str], hint: str | None = None) -> str:
    """VLMEvalKit's MCQ text for the Qwen-VL family (the Chinese instruction when the text has Chinese)."""
    prompt = f"Hint: {hint}\n" if hint else ""
    prompt += f"Question: {question}\n"
    if options:
        prompt += "Options:\n" + "".join(f"{k}. {v}\n" for k, v in options.items())
        prompt += MCQ_CN_PROMPT if _CJK.search(prompt) else MCQ_EN_PROMPT
    return prompt.rstrip()


def rotate(options: dict[str, str], answer: str, r: int) -> tuple[dict[str, str], str]:
    """Rotation ``r`` of the options (letter j shows original option j + r) and the moved gold letter."""
    letters = list(options)
    texts = [options[k] for k in letters]
    n = len(letters)
    rotated = {letters[j]: texts[(j + r) % n] for j in range(n)}
    return rotated, letters[(letters.index(answer) - r) % n]


@dataclass
class _Row:
    n: int  # data row number in the file (1-based)
    index: int
    question: str
    options: dict[str, str]
    answer: str
    category: str
    hint: str | None
    image: ImageInput
    error: str | None
    meta: dict = field(default_factory=dict)


def _parse(path: Path, n: int, row: dict, images: dict[int, bytes | None]) -> _Row | tuple[_Row, str]:
    idx_text = (row.get("index") or "").strip()
    for key in ("index", "question", "answer"):
        if blank(row.get(key)):
            raise DatasetError(f"{path}: row {n} (index={idx_text or '?'}) has no field {key!r}")
    where = f"{path}: row {n} (index={idx_text})"
    try:
        index = int(float(idx_text))
    except ValueError as e:
        raise DatasetError(f"{where}: field 'index' is not a number") from e
    options = {k: row[k].strip() for k in LETTERS if k in row and not blank(row[k])}
    if len(options) < 2:
        raise DatasetError(f"{where}: fewer than two options (fields 'A', 'B', ...)")
    answer = row["answer"].strip().upper()
    if answer not in options:
        raise DatasetError(f"{where}: field 'answer' is {row['answer']!r}, not one of the options {list(options)}")
    category = "uncategorized" if blank(row.get("category")) else row["category"].strip()
    hint = None if blank(row.get("hint")) else row["hint"]
    meta = {}
    for src, dst in (("l2-category", "l2_category"), ("split", "split")):
        if not blank(row.get(src)):
            meta[dst] = row[src].strip()
    key = f"{path.name}:index={index}"
    raw = row.get("image") or ""
    parsed = _Row(n, index, row["question"], options, answer, category, hint,
                  ImageInput(source=SOURCE, key=key), None, meta)
    if is_image_ref(raw):
        return parsed, raw.strip()
    try:
        parsed.image.data = decode_b64(raw)
    except ValueError as e:
        parsed.error = f"image of row {key} cannot be decoded: {e}"
    images[index] = parsed.image.data
    return parsed


def _resolve_ref(row: _Row, ref: str, images: dict[int, bytes | None]) -> None:
    try:
        target = int(float(ref))
    except ValueError:
        row.error = f"image of row {row.image.key} is neither base64 nor a row index: {ref!r}"
        return
    data = images.get(target)
    if data is None:
        row.error = f"image of row {row.image.key} refers to index {target}, which has no usable image in the file"
    row.image.data = data


def _sample(row: _Row, options: dict[str, str], answer: str, rotation: int, uid: str, dataset: str) -> Sample:
    group = str(row.index % ROTATION_STRIDE)
    return Sample(
        uid=uid,
        dataset=dataset,
        task="mcq",
        content=[{"type": "image", "index": 0},
                 {"type": "text", "text": build_prompt(row.question, options, row.hint)}],
        images=[row.image],
        reference={"answer": answer, "options": options, "group": group, "category": row.category,
                   "rotation": rotation},
        meta={"source": SOURCE, "category": row.category, "group": group, "rotation": rotation,
              "index": row.index, "n_options": len(options), **row.meta},
        error=row.error,
    )


def load(cfg, root: Path) -> Iterator[Sample]:
    """CCBench samples, question by question, each followed by its rotations when ``circular``."""
    path = data_path(cfg, root)
    if path.is_dir():
        found = sorted(path.glob("*.tsv"))
        if len(found) != 1:
            raise DatasetError(f"{path}: expected one .tsv file, found {len(found)} (dataset.path)")
        path = found[0]
    dataset = cfg_get(cfg, "name", "ccbench")
    circular = bool(cfg_get(cfg, "circular", True))
    split = cfg_get(cfg, "split")
    limit = cfg_get(cfg, "limit")

    images: dict[int, bytes | None] = {}
    groups: dict[int, list[_Row]] = {}  # in order of first appearance
    refs: list[tuple[_Row, str]] = []
    for n, row in iter_tsv(path, REQUIRED):
        parsed = _parse(path, n, row, images)
        if isinstance(parsed, tuple):
            parsed, ref = parsed
            refs.append((parsed, ref))
        if split and parsed.meta.get("split", split) != split:
            continue
        groups.setdefault(parsed.index % ROTATION_STRIDE, []).append(parsed)
    for parsed, ref in refs:  # after the whole file: a reference may point further down
        _resolve_ref(parsed, ref, images)

    seen: set[str] = set()
    for count, (group, rows) in enumerate(groups.items()):
        if limit is not None and count >= limit:
            return
        rows.sort(key=lambda r: r.index)
        main = [r for r in rows if r.index < ROTATION_STRIDE]
        rotated = [r for r in rows if r.index >= ROTATION_STRIDE]
        if not circular:
            chosen = [(r, r.options, r.answer, 0, str(r.index)) for r in main]
        elif rotated:  # the file carries its own rotations
            chosen = [(r, r.options, r.answer, r.index // ROTATION_STRIDE, str(r.index)) for r in rows]
        else:
            chosen = []
            for r in main:
                for k in range(len(r.options)):
                    opts, ans = rotate(r.options, r.answer, k)
                    chosen.append((r, opts, ans, k, str(r.index + k * ROTATION_STRIDE)))
        for r, opts, ans, k, uid in chosen:
            base, dup = uid, 1
            while uid in seen:  # duplicate indices never share a key
                uid = f"{base}#{dup}"
                dup += 1
            seen.add(uid)
            yield _sample(r, opts, ans, k, uid, dataset)
