"""Multiple-choice scoring for the MMBench family (CCBench): rule-based choice extraction, circular accuracy.

Two extraction rules (``scoring.mcq_extraction``, :func:`extract`); both return None rather than guess, and
an LLM judge (which VLMEvalKit can add after its rules fail) is off:

* ``vlmevalkit`` (default, so that accuracies compare with VLMEvalKit's CCBench numbers) —
  :func:`extract_choice_vlmevalkit`, VLMEvalKit's exact-matching rule (its ``can_infer``: option letters
  first, option texts second, then "failed"), re-implemented from its definition:

  1. a refusal phrase anywhere in the answer ("Sorry, I can't help with images of people yet.", "I can't
     process this file.", "I'm sorry, but without the image provided", "Cannot determine the answer") →
     no answer;
  2. the characters ``. ( ) [ ] , : ; ! * # { }`` become spaces and the text is split at whitespace; if
     exactly one option letter occurs as a whole token (case-sensitive: ``b`` is not ``B``) → that letter
     (so "A cat sits on B" gives nothing, but "A cat" gives A: VLMEvalKit's own quirk, kept); no letter but
     a token ``Z`` → no answer;
  3. otherwise, the options whose text (lower-cased) is a substring of the lower-cased answer: exactly one →
     it;
  4. otherwise no answer (VLMEvalKit's ``Z``, "failed in prefetch" without a judge).

  No Unicode normalisation: a full-width ``Ｂ`` or ``答案是B`` (no space) is not read as B.
* ``lenient`` — :func:`extract_choice`, this project's rules for free-form Chinese/English answers, below
  (reads ``答案是B``, ``（Ｂ）``, ``选B``; ignores English "A"/"I" words). It answers more questions than
  VLMEvalKit's rule would, so its accuracy is not comparable with published VLMEvalKit figures.

**Lenient extraction** (:func:`extract_choice`). The text is NFKC-normalised first (full-width ``Ｂ``, ``（Ｂ）``,
``：`` become ``B``, ``(B)``, ``:``) and markdown emphasis is dropped. Rules, first that decides wins:

1. the whole answer is a letter, optionally bracketed or followed by ``.``/``:``/``)``/``、`` (``B``, ``(B)``);
2. explicit statements — ``答案是B``, ``答案：B``, ``正确答案为B``, ``选B``, ``选择B``, ``The answer is B``,
   ``Answer: (B)``, ``the correct option is B``: one letter → it, two different letters → None;
3. a leading letter with a delimiter (``B. 故宫``, ``(B) …``, ``B、…``, ``B: …``, ``B 故宫``);
4. the option letters standing alone in the text (not inside a Latin word; ``A``/``I`` followed by a
   lower-case word are read as English words, "A cat", unless that word is ``or``, ``and``, ``is``, …
   as in "A or B"): one letter → it, several → None;
5. no letter at all: the option whose text appears in the answer (case-insensitive; an option whose text is
   part of another matching option's text is dropped), if exactly one.

A letter that is not among the options is ignored (rules 2–4) or yields None (rule 1).

**Circular evaluation** (:func:`circular_accuracy`, MMBench): a question with N options is asked N times with
the options rotated and counts as correct only if every rotation is answered correctly. Hosted circular
files number rotation k of question i as ``i + k·1_000_000`` (:func:`circular_group`).
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

CIRCULAR_STRIDE = 1_000_000

_BARE = re.compile(r"^[(\[]?([A-Za-z])[)\]]?[.。:、)]?$")
_EXPLICIT = [
    re.compile(r"(?:正确答案|正确选项|答案|答)\s*(?:应该|应当|应|就|也)?\s*(?:是|为|选)?\s*[:]?\s*[(\[]?([A-Z])(?![A-Za-z])"),
    re.compile(r"(?:选择|选)\s*[(\[]?([A-Z])(?![A-Za-z])"),
    re.compile(r"(?i:answer|correct option|correct choice)\s*(?i:is|would be|should be)?\s*[:=]?\s*"
               r"(?i:option|choice)?\s*[(\[]?([A-Z])(?![A-Za-z])"),
]
_LEADING = re.compile(r"^[(\[]?([A-Z])(?:[)\].:、]|\s+(?=[^\x00-\x7f]))")
_STANDALONE = re.compile(r"(?<![A-Za-z])([A-Z])(?![A-Za-z])")
# "A cat", "I think": A / I before a lower-case word are English words, unless the word is one that follows
# a choice letter ("A or B", "A is correct").
_ENGLISH_WORD_AFTER = re.compile(r"\s+(?!(?:or|and|nor|is|was|seems|looks|should|would|could|might|may|must|"
                                 r"vs|versus)\b)[a-z]")


def _has_text(value: Any) -> bool:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    return bool(str(value).strip())


def _norm(text: str) -> str:
    return re.sub(r"[*_`]", "", unicodedata.normalize("NFKC", text)).strip()


def extract_choice(prediction: str | None, options: Mapping[str, Any]) -> str | None:
    """The option letter a free-text answer chooses, or None when absent or ambiguous (module docstring).

    ``options`` maps letters to option texts; empty / None / NaN texts (missing options in a TSV) are not
    options.
    """
    letters = {str(k).strip().upper(): str(v) for k, v in options.items()
               if len(str(k).strip()) == 1 and str(k).strip().isalpha() and _has_text(v)}
    if not isinstance(prediction, str) or not letters:
        return None
    text = _norm(prediction)
    if not text:
        return None
    bare = _BARE.match(text)
    if bare:
        letter = bare.group(1).upper()
        return letter if letter in letters else None
    explicit = {m.group(1) for rx in _EXPLICIT for m in rx.finditer(text) if m.group(1) in letters}
    if explicit:
        return explicit.pop() if len(explicit) == 1 else None
    leading = _LEADING.match(text)
    if leading and leading.group(1) in letters:
        return leading.group(1)
    standalone = {
        m.group(1) for m in _STANDALONE.finditer(text)
        if m.group(1) in letters and not (m.group(1) in "AI" and _ENGLISH_WORD_AFTER.match(text, m.end()))
    }
    if standalone:
        return standalone.pop() if len(standalone) == 1 else None
    folded = text.casefold()
    found = {k: _norm(v).casefold() for k, v in letters.items() if _norm(v) and _norm(v).casefold() in folded}
    found = [k for k, v in found.items() if not any(v != w and v in w for w in found.values())]
    return found[0] if len(found) == 1 else None


EXTRACTION_RULES = ("vlmevalkit", "lenient")
_VLMEVAL_SEPARATORS = ".()[],:;!*#{}"
_VLMEVAL_REFUSALS = (
    "Sorry, I can't help with images of people yet.",
    "I can't process this file.",
    "I'm sorry, but without the image provided",
    "Cannot determine the answer",
)


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def extract_choice_vlmevalkit(prediction: str | None, options: Mapping[str, Any]) -> str | None:
    """VLMEvalKit's exact-matching choice extraction (module docstring), or None where it infers nothing
    (its ``False`` / ``Z``). ``options`` maps letters to option texts; a missing (None / NaN) text is not an
    option, as VLMEvalKit builds its choices from the non-NaN option columns."""
    if not isinstance(prediction, str):
        return None
    choices = {str(k).strip(): str(v) for k, v in options.items()
               if len(str(k).strip()) == 1 and str(k).strip().isupper() and not _is_missing(v)}
    if not choices:
        return None
    if any(phrase in prediction for phrase in _VLMEVAL_REFUSALS):
        return None
    text = prediction
    for ch in _VLMEVAL_SEPARATORS:
        text = text.replace(ch, " ")
    tokens = set(text.split())
    letters = [c for c in choices if c in tokens]
    if len(letters) == 1:
        return letters[0]
    if not letters and "Z" in tokens:
        return None
    folded = prediction.lower()
    found = [c for c, v in choices.items() if v.lower() in folded]
    return found[0] if len(found) == 1 else None


def extract(prediction: str | None, options: Mapping[str, Any], rule: str = "vlmevalkit") -> str | None:
    """The option letter by ``rule`` (``scoring.mcq_extraction``): ``vlmevalkit`` or ``lenient``."""
    if rule == "vlmevalkit":
        return extract_choice_vlmevalkit(prediction, options)
    if rule == "lenient":
        return extract_choice(prediction, options)
    raise ValueError(f"scoring.mcq_extraction={rule!r}: expected one of {', '.join(EXTRACTION_RULES)}")


def circular_group(index: Any) -> int:
    """The original question of a row of a circular file: ``index % 1_000_000``."""
    return int(index) % CIRCULAR_STRIDE


def _correct(record: Mapping[str, Any]) -> bool:
    pred, gold = record.get("pred"), record.get("gold")
    if record.get("error") or pred is None or gold is None:
        return False
    return str(pred).strip().upper() == str(gold).strip().upper()


def _mean_by(keys: list[str], hits: list[bool]) -> dict[str, float]:
    table: dict[str, list[int]] = {}
    for k, h in zip(keys, hits):
        entry = table.setdefault(k, [0, 0])
        entry[0] += h
        entry[1] += 1
    return {k: c / n for k, (c, n) in sorted(table.items())}


def circular_accuracy(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Circular (all rotations right) and per-row accuracy, overall and per category.

    Each record has ``group`` (the original question; else ``index``, mapped by :func:`circular_group`),
    ``category``, ``pred`` (letter or None) and ``gold`` (letter); a record with ``error`` or no ``pred`` is
    wrong. A group's category is its first record's. Returns ``mcq_accuracy`` and
    ``mcq_accuracy_per_category`` (circular), ``mcq_row_accuracy`` and ``mcq_row_accuracy_per_category``
    (every row on its own, not circular: for reference), ``n_questions``, ``n_rows``, ``unparsed`` (rows
    without a prediction) and ``errors``. Empty input → counts 0 and accuracies None.
    """
    rows = list(records)
    groups: dict[Any, list[bool]] = {}
    group_category: dict[Any, str] = {}
    row_hits, row_cats = [], []
    for r in rows:
        key = r["group"] if r.get("group") is not None else circular_group(r["index"])
        hit, cat = _correct(r), str(r.get("category") or "unknown")
        groups.setdefault(key, []).append(hit)
        group_category.setdefault(key, cat)
        row_hits.append(hit)
        row_cats.append(cat)
    q_hits = [all(h) for h in groups.values()]
    q_cats = [group_category[k] for k in groups]
    return {
        "mcq_accuracy": sum(q_hits) / len(q_hits) if q_hits else None,
        "mcq_accuracy_per_category": _mean_by(q_cats, q_hits),
        "mcq_row_accuracy": sum(row_hits) / len(row_hits) if row_hits else None,
        "mcq_row_accuracy_per_category": _mean_by(row_cats, row_hits),
        "n_questions": len(groups),
        "n_rows": len(rows),
        "unparsed": sum(1 for r in rows if r.get("pred") is None and not r.get("error")),
        "errors": sum(1 for r in rows if r.get("error")),
    }
