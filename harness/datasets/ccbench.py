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

from harness.datasets._io import blank, cfg_get, config_key, data_path, decode_b64, is_image_ref, iter_tsv
from harness.datasets.base import DatasetError, ImageInput, Sample
from harness.datasets.faults import RowFault, UniqueIds, cell, data_error_sample

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
    error_reason: str | None = None


def _parse(n: int, row: dict, images: dict[int, bytes | None], key_of: str) -> _Row | tuple[_Row, str]:
    """One TSV row checked against the MCQ schema; a defect is a :class:`RowFault`.

    ``question`` and ``answer`` required, ``index`` an integer, at least two options with consecutive letters
    from ``A`` (an empty field after the last option is fine, a gap is not: the prompt would skip a letter)
    and the answer one of them."""
    index_text = cell(row, "index").strip()
    try:
        index = int(index_text)
    except ValueError as e:
        raise RowFault("bad_index", f"field 'index' is {index_text!r}, not an integer") from e
    question = cell(row, "question")
    answer_text = cell(row, "answer")
    options = {k: row[k].strip() for k in LETTERS if k in row and not blank(row[k])}
    if len(options) < 2:
        raise RowFault("too_few_options", f"{len(options)} option(s) (fields 'A', 'B', ...); a question needs two")
    if "".join(options) != LETTERS[: len(options)]:
        raise RowFault("option_gap", f"options {''.join(options)} skip a letter (expected {LETTERS[:len(options)]})")
    answer = answer_text.strip().upper()
    if answer not in options:
        raise RowFault("answer_not_an_option",
                       f"field 'answer' is {answer_text!r}, not one of the options {list(options)}")
    category = "uncategorized" if blank(row.get("category")) else row["category"].strip()
    hint = None if blank(row.get("hint")) else row["hint"]
    meta = {}
    for src, dst in (("l2-category", "l2_category"), ("split", "split")):
        if not blank(row.get(src)):
            meta[dst] = row[src].strip()
    key = f"{key_of}:index={index}"
    raw = row.get("image") or ""
    parsed = _Row(n, index, question, options, answer, category, hint, ImageInput(source=SOURCE, key=key), None, meta)
    if is_image_ref(raw):
        return parsed, raw.strip()
    try:
        parsed.image.data = decode_b64(raw)
    except ValueError as e:
        parsed.error, parsed.error_reason = f"image of row {key} cannot be decoded: {e}", "image_undecodable"
    images.setdefault(index, parsed.image.data)  # a repeated index never replaces the image rows refer to
    return parsed


def _resolve_ref(row: _Row, ref: str, images: dict[int, bytes | None]) -> None:
    try:
        target = int(float(ref))
    except ValueError:
        row.error = f"image of row {row.image.key} is neither base64 nor a row index: {ref!r}"
        row.error_reason = "image_undecodable"
        return
    data = images.get(target)
    if data is None:
        row.error = f"image of row {row.image.key} refers to index {target}, which has no usable image in the file"
        row.error_reason = "image_ref_unresolved"
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
        error_reason=row.error_reason if row.error else None,
    )


def _error_sample(uid: str, dataset: str, where: str, fault: RowFault, row: dict, group: str) -> Sample:
    """A defective row: one data-error sample standing for its whole question (all rotations), so the
    question counts as wrong in the circular accuracy."""
    category = "uncategorized" if blank(row.get("category")) else row["category"].strip()
    return data_error_sample(uid, dataset, "mcq", where, fault,
                             reference={"answer": None, "options": {}, "group": group, "category": category,
                                        "rotation": 0},
                             meta={"source": SOURCE, "category": category, "group": group, "rotation": 0})


def load(cfg, root: Path) -> Iterator[Sample]:
    """CCBench samples, question by question, each followed by its rotations when ``circular``.

    A defective row (no question, answer not an option, a repeated index, wrong number of fields...) is a
    data-error sample in place of its question's rotations; a defective file stops with a
    :class:`DatasetError`."""
    path = data_path(cfg, root)
    if path.is_dir():
        found = sorted(path.glob("*.tsv"))
        if len(found) != 1:
            raise DatasetError(f"{path}: expected one .tsv file, found {len(found)} ({config_key(cfg, 'path')})")
        path = found[0]
    dataset = cfg_get(cfg, "name", "ccbench")
    circular = bool(cfg_get(cfg, "circular", True))
    split = cfg_get(cfg, "split")
    limit = cfg_get(cfg, "limit")

    images: dict[int, bytes | None] = {}
    groups: dict[str, list[_Row | Sample]] = {}  # in order of first appearance; a Sample is a bad row
    refs: list[tuple[_Row, str]] = []
    indices: set[int] = set()
    other_splits: set[str] = set()
    for n, line, row, column_fault in iter_tsv(path, REQUIRED, config_key(cfg, "path")):
        idx_text = (row.get("index") or "").strip()
        where = f"{path}:{line}: row {n} (index={idx_text or '?'})"
        try:
            if column_fault:
                raise RowFault("wrong_column_count", column_fault)
            parsed = _parse(n, row, images, path.name)
            index = (parsed[0] if isinstance(parsed, tuple) else parsed).index
            if index in indices:
                raise RowFault("duplicate_id", f"index {index} is used by an earlier row (indices key results)")
            indices.add(index)
        except RowFault as fault:
            if split and not blank(row.get("split")) and row["split"].strip() != split:
                other_splits.add(row["split"].strip())
                continue
            try:
                group = str(int(idx_text) % ROTATION_STRIDE)
            except ValueError:
                group = f"row{n}"
            groups.setdefault(group, []).append(_error_sample(group, dataset, where, fault, row, group))
            continue
        if isinstance(parsed, tuple):
            parsed, ref = parsed
            refs.append((parsed, ref))
        if split and parsed.meta.get("split", split) != split:
            other_splits.add(parsed.meta["split"])
            continue
        groups.setdefault(str(parsed.index % ROTATION_STRIDE), []).append(parsed)
    for parsed, ref in refs:  # after the whole file: a reference may point further down
        _resolve_ref(parsed, ref, images)
    if not groups and other_splits:
        raise DatasetError(f"{path}: no row has split {split!r} (set by {config_key(cfg, 'split')}); "
                           f"the file's splits: {sorted(other_splits)}")

    ids = UniqueIds()
    for count, (group, rows) in enumerate(groups.items()):
        if limit is not None and count >= limit:
            return
        bad = [r for r in rows if isinstance(r, Sample)]
        good = sorted((r for r in rows if not isinstance(r, Sample)), key=lambda r: r.index)
        for s in bad:  # the question's defective rows, each once (uids unique: a group can have several)
            s.uid, _ = ids.claim(s.uid if not good else f"{s.uid}#bad")
            yield s
        main = [r for r in good if r.index < ROTATION_STRIDE]
        rotated = [r for r in good if r.index >= ROTATION_STRIDE]
        if not circular:
            chosen = [(r, r.options, r.answer, 0, str(r.index)) for r in main]
        elif rotated:  # the file carries its own rotations
            chosen = [(r, r.options, r.answer, r.index // ROTATION_STRIDE, str(r.index)) for r in good]
        else:
            chosen = []
            for r in main:
                for k in range(len(r.options)):
                    opts, ans = rotate(r.options, r.answer, k)
                    chosen.append((r, opts, ans, k, str(r.index + k * ROTATION_STRIDE)))
        for r, opts, ans, k, uid in chosen:
            uid, _ = ids.claim(uid)
            yield _sample(r, opts, ans, k, uid, dataset)
