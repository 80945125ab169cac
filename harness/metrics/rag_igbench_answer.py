"""RAG-IGBench answers: a model's raw output → the ``answer`` markdown, and what that markdown holds.

The answer format is the paper's (NeurIPS 2025 D&B, arXiv 2512.05119; the prompt is
``harness/datasets/prompts/rag_igbench_zh.jinja``): a JSON object ``{"reason", "category", "answer"}`` whose
``answer`` is markdown. In it image ``k`` of the candidates (1-based over all notes' images, flattened) is placed
as ``![...](IMG#k)`` and a citation is ``<sup>[n](DOC#n)</sup>``. :func:`parse_answer` takes the markdown out of
the raw text; :func:`image_ids`, :func:`clean_text` and :func:`image_contexts` read a markdown answer (the
model's or the reference's) as the public scorer (zry13/RAG-IGBench ``score/eval.py``) does.

Why a module of its own: reading an answer is a different job from scoring it, and it has users that score
nothing — a run's ``samples.jsonl`` records the parsed answer (:mod:`harness.run.outcome`), the scorer-training
data takes image contexts (:mod:`harness.metrics.scorer_data`). The scoring (Rouge-1, edit, Kendall, CLIP,
alignment, :func:`~harness.metrics.rag_igbench.score_sample`, :func:`~harness.metrics.rag_igbench.aggregate`)
stays in :mod:`harness.metrics.rag_igbench`, which reads answers through this module. And the parsing is its
own piece of work: models write malformed JSON (code fences, text around the object, trailing commas, single
quotes, raw newlines, unescaped inner quotes, output cut by the token limit), and :func:`parse_answer` repairs
these by trying, in a fixed order, the readings its docstring lists — the first reading that finds an
``answer`` field decides (a non-string answer gives None). It returns only that markdown, or None; it does not
say which repair was needed. A None is what :func:`~harness.metrics.rag_igbench.score_sample` reports as
``format_invalid``.

Where this departs from the public scorer: extraction is more lenient than its ``fix_json`` (``"answer":"``
without a space, single quotes, trailing commas, text around the object, several code fences) and keeps the
answer text as written, whereas ``fix_json`` turns newlines into ``<br>`` and inner ``"`` into ``'`` in the
model answer only, which lengthens the model's context windows and adds ``br`` to its Rouge words but not to
the reference's (listed in :data:`harness.metrics.rag_igbench.DEPARTURES_WITHOUT_OPTION`).

Only the standard library is imported.
"""

from __future__ import annotations

import ast
import json
import re
import warnings
from typing import Any

#: ``![anything](IMG#k)`` as the reference matches it (lazy alt text, no line break inside).
IMAGE_TAG = re.compile(r"!\[.*?\]\(IMG#(\d+)\)")
#: ``<sup>[n](DOC#n)</sup>`` citations, removed from the text before anything else.
CITATION = re.compile(r"<sup>\[.*?\]\(.*?\)</sup>")
#: Characters taken on each side of an image tag for its context (reference: ``context_length = 20``).
CONTEXT_WINDOW = 20


# ---------------------------------------------------------------------------------------------------- answer

_FENCED = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?(.*?)(?:```|\Z)", re.S)
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")
_ANSWER_KEY = re.compile(r"""(["'])answer\1\s*:\s*(["'])""", re.I)
_NEXT_FIELD = re.compile(r"""\s*,\s*["'][\w -]+["']\s*:""")
_CLOSE = re.compile(r"\s*(?:}|(?:```)?\s*\Z)")
_DECODER = json.JSONDecoder(strict=False)  # strict=False: raw newlines/tabs inside strings are accepted
_MISSING = object()


def _answer_of(obj: Any) -> Any:
    """The ``answer`` field of a parsed object (key matched case-insensitively), or _MISSING."""
    if not isinstance(obj, dict):
        return _MISSING
    if "answer" in obj:
        return obj["answer"]
    for key, value in obj.items():
        if isinstance(key, str) and key.strip().lower() == "answer":
            return value
    return _MISSING


def _from_json(text: str) -> tuple[Any, bool]:
    """(answer or _MISSING, whether any JSON object parsed) scanning every ``{`` of the text."""
    parsed_any, i = False, text.find("{")
    while i != -1:
        try:
            obj, end = _DECODER.raw_decode(text, i)
        except (ValueError, RecursionError):
            i = text.find("{", i + 1)
            continue
        parsed_any = parsed_any or isinstance(obj, dict)
        answer = _answer_of(obj)
        if answer is not _MISSING:
            return answer, True
        i = text.find("{", max(end, i + 1))
    return _MISSING, parsed_any


def _from_python_literal(text: str) -> Any:
    """The answer of a Python-literal dict (single quotes, trailing commas) between the outer braces."""
    start, end = text.find("{"), text.rfind("}")
    if start == -1 or end <= start:
        return _MISSING
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences in model text
            return _answer_of(ast.literal_eval(text[start : end + 1]))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _MISSING


def _unescape(value: str, quote: str) -> str:
    """Decode a string literal's body whose inner quotes may be unescaped."""
    if quote == '"':
        escaped = re.sub(r'(?<!\\)((?:\\\\)*)"', r'\1\\"', value)
        try:
            return json.loads(f'"{escaped}"', strict=False)
        except ValueError:
            pass
    table = {"n": "\n", "t": "\t", "r": "\r"}
    return re.sub(r"\\(.)", lambda m: table.get(m.group(1), m.group(1)), value, flags=re.S)


def _from_field(text: str) -> Any:
    """Last resort: the text after ``"answer": "`` up to the quote that closes the field.

    The closing quote is the first unescaped one followed by another quoted key, else the last one followed
    by ``}`` or the end of the text. Without either the output was cut (e.g. by the token limit) and the
    answer runs to the end of the text, as the reference's ``fix_json`` also accepts.
    """
    m = _ANSWER_KEY.search(text)
    if not m:
        return _MISSING
    quote, start = m.group(2), m.end()
    closing = None
    for j in (i for i in range(start, len(text)) if text[i] == quote):
        body = text[start:j]
        if (len(body) - len(body.rstrip("\\"))) % 2:
            continue  # an escaped quote
        if _NEXT_FIELD.match(text, j + 1):
            return _unescape(body, quote)
        if _CLOSE.match(text, j + 1):
            closing = body
    if closing is None:
        closing = text[start:].rstrip().removesuffix("```").rstrip().rstrip("\\")
    return _unescape(closing, quote)


def parse_answer(raw: str | None) -> str | None:
    """The ``answer`` markdown of a model's JSON output, or None when the format is invalid.

    Reference: strip code fences, repair the JSON, take ``answer``. Tried in order, first on the whole text
    and then on each fenced block: strict JSON at every ``{`` (raw newlines in strings allowed); the same
    with trailing commas removed; a Python literal (single quotes); and, only if no JSON object parsed at all,
    the raw ``answer`` field (unescaped inner quotes, output cut before the closing quote). None when nothing
    yields an ``answer``, when a JSON object parses but has no ``answer`` key, or when the answer is not a
    string (null, a number, a list).
    """
    if not isinstance(raw, str):
        return None
    text = raw.strip()
    candidates = [text] + ([m.group(1) for m in _FENCED.finditer(text)] if "```" in text else [])
    answer, parsed_any = _MISSING, False
    for stage in ("json", "commas", "literal"):
        for cand in candidates:
            if stage == "json":
                answer, parsed = _from_json(cand)
                parsed_any = parsed_any or parsed
            elif stage == "commas":
                answer, _ = _from_json(_TRAILING_COMMA.sub(r"\1", cand))
            else:
                answer = _from_python_literal(cand)
            if answer is not _MISSING:
                return answer if isinstance(answer, str) else None
    if not parsed_any:
        for cand in candidates:
            answer = _from_field(cand)
            if answer is not _MISSING:
                return answer
    return None


# ---------------------------------------------------------------------------------------------- markdown


def image_ids(markdown: str | None) -> list[int]:
    """The ``k`` of every ``![...](IMG#k)`` in order of appearance, repeats kept (reference: ``images``)."""
    return [int(k) for k in IMAGE_TAG.findall(markdown)] if isinstance(markdown, str) else []


def clean_text(markdown: str | None) -> str:
    """The answer text for Rouge: citations removed, then image tags removed, then stripped."""
    if not isinstance(markdown, str):
        return ""
    return IMAGE_TAG.sub("", CITATION.sub("", markdown)).strip()


def image_contexts(markdown: str | None, window: int = CONTEXT_WINDOW, unique: bool = True
                   ) -> list[tuple[int, str]]:
    """(k, text around image k) for the placed images, as the reference defines the context.

    Citations are removed first; the context is the ``window`` characters before the tag's start and after
    its end in that text (fewer at the edges), with the complete image tags inside it removed (so it may
    hold fewer than 2·window characters). With ``unique`` (the reference, which keys a dict by ``k``) each
    image appears once, in order of first appearance, with the context of its **last** occurrence; without
    it every occurrence is listed. CLIP reads the first :data:`~harness.metrics.rag_igbench.CLIP_TEXT_CHARS`
    characters of a context, i.e. mostly the text just before the image.
    """
    if not isinstance(markdown, str):
        return []
    text, window = CITATION.sub("", markdown), max(0, int(window))
    pairs = [
        (int(m.group(1)), IMAGE_TAG.sub("", text[max(0, m.start() - window) : m.end() + window]))
        for m in IMAGE_TAG.finditer(text)
    ]
    return list(dict(pairs).items()) if unique else pairs
