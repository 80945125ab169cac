"""Multiple-choice scoring for the MMBench family (CCBench): rule-based choice extraction, circular accuracy.

Three extraction rules (``scoring.mcq_extraction``, :func:`extract`); each returns None rather than guess, and
an LLM judge (which VLMEvalKit can add after its rules fail) is off:

* ``vlmevalkit`` (default, so that accuracies compare with VLMEvalKit's current CCBench numbers) —
  :func:`extract_choice_vlmevalkit`, VLMEvalKit's exact-matching rule (``can_infer`` in
  ``vlmeval/utils/matching_util.py``) as it stands at :data:`VLMEVALKIT_REVISION` (open-compass/VLMEvalKit
  commit 2cf2a36c6e79, 2026-06-25, the newest change of that file; the rule itself was last changed by
  a67ace50033b, 2026-06-17, and c3371551bb84, 2025-08-04), written here from its definition. Two stages;
  the second runs only when the first infers nothing:

  *Option letters.*

  1. an answer containing "Failed to obtain answer via API" (an API client's failure sentinel) skips this
     stage (the option-text stage still runs);
  2. a refusal phrase anywhere in the answer ("Sorry, I can't help with images of people yet.", "I can't
     process this file.", "I'm sorry, but without the image provided", "Cannot determine the answer") →
     no answer, and the text stage does not run (VLMEvalKit's ``Z``);
  3. the characters ``. ( ) [ ] , : ; ! * # { }`` become spaces and the text is split at whitespace into
     tokens. If exactly one option letter occurs as a whole token (case-sensitive: ``b`` is not ``B``), it is
     the answer only when its first occurrence is **among the last 4 tokens** ("B is right because …" gives
     nothing here). If no option letter occurs but a token ``Z`` does → no answer, text stage skipped;
  4. otherwise (no letter, several letters, or the lone letter too early): the first
     ``answer is X`` (case-insensitive, also ``correct answer is``; whitespace between the words; X one of
     ``A``–``D`` in either case, optionally wrapped in ``*``; nothing is required after X, so "the answer is
     Beijing" reads B) whose upper-cased X is an option → X.

  *Option texts.* If the answer (lower-cased) is **longer than twice the options' total text length**
  (the options' texts as given, summed) → no answer. Otherwise the options whose lower-cased text is a
  substring of the lower-cased answer: exactly one → it; else no answer (VLMEvalKit's "failed in
  prefetch" without a judge).

  Options are the letters with a non-missing text (None / NaN are not options; an empty text is, as in
  VLMEvalKit). VLMEvalKit's ``VERBOSE`` environment switch (which, when set, refuses a lone letter if the
  token ``A`` occurs among more than 3 tokens) is not reproduced: it is off by default there.
* ``vlmevalkit_2025`` — :func:`extract_choice_vlmevalkit_2025`, the rule this project implemented before
  (VLMEvalKit before 2025-08-04, e.g. at aca64dbb3113, 2025-04-08), kept for comparison with older published
  numbers: the same as above without the length guard, without the last-4-tokens condition (any lone
  letter counts: "A cat" gives A), without the ``answer is X`` pattern, and without the API-failure skip
  (which VLMEvalKit already had then: an answer containing that sentence is read like any other here).
* ``lenient`` — :func:`extract_choice`, this project's rules for free-form Chinese/English answers, below
  (reads ``答案是B``, ``（Ｂ）``, ``选B``; ignores English "A"/"I" words). It answers more questions than
  VLMEvalKit's rule would, so its accuracy is not comparable with published VLMEvalKit figures.

No Unicode normalisation in the two VLMEvalKit rules: a full-width ``Ｂ``, ``答案是B`` or ``答案：B`` (a full-width
colon is not a separator there) gives no letter.

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


EXTRACTION_RULES = ("vlmevalkit", "vlmevalkit_2025", "lenient")
#: The public revision that ``vlmevalkit`` reproduces (recorded in ``summary.json`` ``run.scoring``).
VLMEVALKIT_REVISION = {
    "repo": "open-compass/VLMEvalKit", "path": "vlmeval/utils/matching_util.py", "function": "can_infer",
    "commit": "2cf2a36c6e79b51faf676a7011b3a0f5b579814d", "date": "2026-06-25",
}
#: The public revision that ``vlmevalkit_2025`` follows (the rule before 2025-08-04), bar the API-failure skip.
VLMEVALKIT_2025_REVISION = {
    "repo": "open-compass/VLMEvalKit", "path": "vlmeval/utils/matching_util.py", "function": "can_infer",
    "commit": "aca64dbb3113ebf09683e379c65fb8b5107cba3f", "date": "2025-04-08",
    "departs": "no 'Failed to obtain answer via API' skip",
}
RULE_SOURCES = {"vlmevalkit": VLMEVALKIT_REVISION, "vlmevalkit_2025": VLMEVALKIT_2025_REVISION, "lenient": None}

_VLMEVAL_SEPARATORS = ".()[],:;!*#{}"
_VLMEVAL_REFUSALS = (
    "Sorry, I can't help with images of people yet.",
    "I can't process this file.",
    "I'm sorry, but without the image provided",
    "Cannot determine the answer",
)
_VLMEVAL_API_FAILURE = "Failed to obtain answer via API"
_VLMEVAL_LAST_TOKENS = 4
# "answer is X" / "correct answer is **X**", any case; X in A-D of either case
_VLMEVAL_ANSWER_IS = re.compile(r"answer\s+is\s+\**([A-Da-d])", re.I)

_NO_ANSWER = "Z"  # VLMEvalKit's "no answer" letter: stops the search, read as None


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _vlmeval_choices(options: Mapping[str, Any]) -> dict[str, str]:
    """Option letter → text, letters A-Z in alphabetical order, missing (None / NaN) texts left out."""
    given = {str(k).strip(): v for k, v in options.items()}
    return {c: str(given[c]) for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c in given and not _is_missing(given[c])}


def _vlmeval_tokens(prediction: str) -> list[str]:
    text = prediction
    for ch in _VLMEVAL_SEPARATORS:
        text = text.replace(ch, " ")
    return text.split()


def _vlmeval_letter(prediction: str, choices: Mapping[str, str], current: bool) -> str | None:
    """The option-letter stage: a letter, ``Z`` (no answer, stop) or None (go on to the option texts)."""
    if current and _VLMEVAL_API_FAILURE in prediction:
        return None
    if any(phrase in prediction for phrase in _VLMEVAL_REFUSALS):
        return _NO_ANSWER
    tokens = _vlmeval_tokens(prediction)
    letters = [c for c in choices if c in tokens]
    if len(letters) == 1:
        first = tokens.index(letters[0])
        if not current or first >= len(tokens) - _VLMEVAL_LAST_TOKENS:
            return letters[0]
    elif not letters and "Z" in tokens:
        return _NO_ANSWER
    if current:
        m = _VLMEVAL_ANSWER_IS.search(prediction)
        if m and m.group(1).upper() in choices:
            return m.group(1).upper()
    return None


def _vlmeval_text(prediction: str, choices: Mapping[str, str], current: bool) -> str | None:
    """The option-text stage: the one option whose text the answer contains (case-insensitive)."""
    folded = prediction.lower()
    if current and len(folded) > 2 * sum(len(v) for v in choices.values()):
        return None
    found = [c for c, v in choices.items() if v.lower() in folded]
    return found[0] if len(found) == 1 else None


def _vlmeval_extract(prediction: Any, options: Mapping[str, Any], current: bool) -> str | None:
    if not isinstance(prediction, str):
        return None
    choices = _vlmeval_choices(options)
    if not choices:
        return None
    letter = _vlmeval_letter(prediction, choices, current)
    if letter is not None:
        return None if letter == _NO_ANSWER else letter
    return _vlmeval_text(prediction, choices, current)


def extract_choice_vlmevalkit(prediction: str | None, options: Mapping[str, Any]) -> str | None:
    """VLMEvalKit's current exact-matching choice extraction (module docstring, :data:`VLMEVALKIT_REVISION`),
    or None where it infers nothing (its ``False`` / ``Z``). ``options`` maps letters to option texts; a
    missing (None / NaN) text is not an option, as VLMEvalKit builds its choices from the non-NaN option
    columns."""
    return _vlmeval_extract(prediction, options, current=True)


def extract_choice_vlmevalkit_2025(prediction: str | None, options: Mapping[str, Any]) -> str | None:
    """The pre-August-2025 VLMEvalKit rule as this project implemented it (module docstring): a lone option
    letter anywhere, then option texts without a length guard."""
    return _vlmeval_extract(prediction, options, current=False)


def extract(prediction: str | None, options: Mapping[str, Any], rule: str = "vlmevalkit") -> str | None:
    """The option letter by ``rule`` (``scoring.mcq_extraction``): ``vlmevalkit``, ``vlmevalkit_2025`` or
    ``lenient``."""
    if rule == "vlmevalkit":
        return extract_choice_vlmevalkit(prediction, options)
    if rule == "vlmevalkit_2025":
        return extract_choice_vlmevalkit_2025(prediction, options)
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
