"""Seeded text-only tasks the embedded model learns (recipe v7, issue 28), in OpenCompass's custom-dataset format.

Why: OpenCompass's suites are text-only, and before v7 the embedded model had only been trained on image
tasks, so ``python -m harness.opencompass`` on the CI suite scored chance whatever SERE or top-K did (issue
28). These four families give it text it has learnt, with held-out items it has never seen, so the seed's
quality table (baseline / SERE K=2 / plain top-2) can be measured on the embedded model:

- ``text_arith`` (QA): two-digit addition, ``"47+85="`` → ``"132"``;
- ``text_list`` (QA): list operations on 4-6 digits, ``"sort: 7 3 9 1"`` → ``"1 3 7 9"`` (also ``reverse``,
  ``copy``);
- ``text_lookup`` (QA): key-value lookup in a short passage, ``"K=37 R=82 E=15 X=64. R?"`` → ``"82"``;
- ``text_choice`` (multiple choice): the same kind of passage, the answer picked among options A-D (the
  passage's values, shuffled), answered by the letter.

Training only (recipe v7c): ``text_lookup2`` / ``text_choice2``, the same tasks over a passage of two pairs (the
choice's other two options are values from no pair). v7b learnt arithmetic and lists but left lookup and choice at
chance (docs/embedded_model_v7.md §7): both need the induction step (find the key, read the value after it), and
two pairs make it a one-bit decision the gradient can find before the four-pair tasks ask for it. The held-out
evaluation and the OpenCompass suite keep the four-pair tasks.

Closed-book (session 16; taught by recipe v7g, the committed model since session 17, and the OpenCompass CI suite's
``harness_text_recall`` file): ``text_recall``,
``"recall PK"`` → ``"4817"``, from a fixed fact table (:func:`recall_facts`) that no prompt contains, so the answer
is held in the weights rather than read from the prompt (docs/embedded_model_v7.md §12).

The QA answers are 2-9 tokens, so most of each answer comes from decode steps, where SERE and ``moe.top_k``
act (a one-token answer comes from prefill, which keeps the router's own top-k). Digits are single tokens in
the embedded model's tokenizer, so arithmetic and sorting are digit-wise.

The prompt the model is trained on is exactly the one OpenCompass sends for the row (:func:`oc_prompt`,
``make_mcq_gen_config`` / ``make_qa_gen_config`` with no meta template: QA = the question, MCQ = ``Question:``,
the option lines and ``Answer:``), which a test checks against OpenCompass's own trace.

Split: ``tasks.is_heldout(key)`` on the prompt, as every synthetic task: an eighth is held-out and each split
rejects the other's keys. The OpenCompass ``ci_sample`` suite is drawn from the held-out split.
Only the standard library is imported (the training script runs on a GPU machine without Hydra).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from harness.datasets.synthetic.tasks import _in_split

TEXT_TASKS = ("text_arith", "text_list", "text_lookup", "text_choice")
TRAIN_ONLY_TEXT_TASKS = ("text_lookup2", "text_choice2")  # two-pair passages (recipe v7c), never evaluated
# closed-book recall (session 16, issue 28): facts only the weights hold, so the MLP experts carry the answer
CLOSED_BOOK_TASKS = ("text_recall",)
PAIRS = {"text_lookup": 4, "text_choice": 4, "text_lookup2": 2, "text_choice2": 2}
MCQ_TASKS = ("text_choice",)
LIST_OPS = ("sort", "reverse", "copy")
KEYS = "EHKLNPRTXY"  # capitals that are no option letter (A-D), one token each
LETTERS = "ABCD"


@dataclass
class TextItem:
    """One text request: ``question`` (the dataset row's question), ``answer`` (QA: the text; MCQ: the
    letter) and, for multiple choice, ``options`` (letter -> option text)."""

    key: str
    task: str
    question: str
    answer: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return oc_prompt(self.question, self.options)

    def row(self) -> dict[str, str]:
        """The OpenCompass custom-format row (``question``, options ``A``-``D`` for MCQ, ``answer``)."""
        return {"question": self.question, **self.options, "answer": self.answer}


def oc_prompt(question: str, options: dict[str, str] | None = None) -> str:
    """What OpenCompass 0.5 sends the model for a custom-format row (no meta template; ``gen`` mode: the BOT
    turn is cut at the answer column, turns joined by newlines)."""
    if not options:
        return question
    return "Question: " + question + "".join(f"\n{k}. {v}" for k, v in options.items()) + "\nAnswer: "


def _passage(rng: random.Random, pairs: int = 4) -> tuple[list[str], list[str]]:
    """``pairs`` distinct keys and 4 distinct values: the first ``pairs`` values are the passage's, the rest the
    distractor options of a passage shorter than four pairs."""
    keys = rng.sample(KEYS, pairs)
    values = [str(v) for v in rng.sample(range(10, 100), 4)]
    return keys, values


def recall_facts(n: int = 90, seed: int = 0) -> dict[str, str]:
    """The closed-book fact table: ``n`` two-letter codes (ordered pairs of distinct :data:`KEYS`) -> a 4-digit
    value, a pure function of (n, seed).

    Why (issue 28): every other text task carries its answer in the prompt, and plain top-2 costs them nothing
    however the experts are drawn or weighted (docs/embedded_model_v7.md §11). A fact table that appears in no
    prompt can only be held in the weights — in a MoE, much of it in the experts — which is what truncating experts
    removes in a real model (the seed's OpenCompass collapse under plain top-2). Measured (§12): plain top-1 loses
    a quarter to a half of the facts where SERE K=1 keeps them; plain top-2 still loses only a few. Four digits: the first comes from prefill (the router's own top-k), the other
    three from decode steps, where SERE and ``moe.top_k`` act."""
    rng = random.Random(f"recall-facts:{seed}")
    codes = [a + b for a in KEYS for b in KEYS if a != b]
    rng.shuffle(codes)
    return {c: str(rng.randint(1000, 9999)) for c in sorted(codes[:n])}


RECALL_FACTS = recall_facts()
RECALL_CODES = tuple(RECALL_FACTS)  # the table's codes in its (sorted) order: what a training draw picks from


def recall_item(code: str) -> TextItem:
    """The ``text_recall`` question for one fact of :data:`RECALL_FACTS` (its prompt names only the code)."""
    return TextItem("text:recall:" + code, "text_recall", f"recall {code}", RECALL_FACTS[code])


def recall_items() -> list[TextItem]:
    """Every fact once, in the table's order: what a checkpoint taught the table is evaluated on (the share of it
    recalled, with no sampling noise from drawing a fact twice)."""
    return [recall_item(c) for c in RECALL_FACTS]


def _draw(task: str, rng: random.Random) -> TextItem:
    if task == "text_recall":
        return recall_item(rng.choice(RECALL_CODES))
    if task == "text_arith":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        q = f"{a}+{b}="
        return TextItem("text:" + q, task, q, str(a + b))
    if task == "text_list":
        op = rng.choice(LIST_OPS)
        xs = [rng.randint(0, 9) for _ in range(rng.randint(4, 6))]
        ys = sorted(xs) if op == "sort" else xs[::-1] if op == "reverse" else xs
        q = f"{op}: " + " ".join(map(str, xs))
        return TextItem("text:" + q, task, q, " ".join(map(str, ys)))
    if task not in PAIRS:
        raise ValueError(f"unknown text task {task!r}; expected one of {TEXT_TASKS + TRAIN_ONLY_TEXT_TASKS}")
    pairs = PAIRS[task]
    keys, values = _passage(rng, pairs)
    i = rng.randrange(pairs)
    passage = " ".join(f"{k}={v}" for k, v in zip(keys, values)) + f". {keys[i]}?"
    if task.startswith("text_lookup"):
        return TextItem("text:" + passage, task, passage, values[i])
    order = rng.sample(range(4), 4)  # text_choice*: the four values as options A-D
    options = {LETTERS[j]: values[o] for j, o in enumerate(order)}
    return TextItem("text:choice:" + passage, task, passage, LETTERS[order.index(i)], options)


def text_item(task: str, rng: random.Random, split: str) -> TextItem:
    """One item of ``task`` from ``split`` (redrawn until its key falls in the split). A closed-book task has no
    held-out items — a fact never trained cannot be recalled — so both splits draw from its whole fact table (as a
    knowledge benchmark asks what pre-training saw): it measures memory, not generalisation."""
    if task in CLOSED_BOOK_TASKS:
        return _draw(task, rng)
    while True:
        item = _draw(task, rng)
        if _in_split(item.key, split):
            return item


def items(task: str, split: str, n: int, seed: int = 0) -> list[TextItem]:
    """``n`` items of ``task`` from ``split``, a pure function of (task, split, n, seed)."""
    rng = random.Random(f"text:{task}:{split}:{seed}")
    return [text_item(task, rng, split) for _ in range(n)]


def mcq_choice(pred: str, options: dict[str, str]) -> str:
    """The option a multiple-choice answer picks, as OpenCompass's ``OptionSimAccEvaluator`` reads it (its first
    three rules: the answer is a letter; the first option letter in it; the one option whose text it contains);
    "" where none applies (OpenCompass's last rule, the nearest option by edit distance, is not reproduced:
    the training-time check counts such an answer wrong)."""
    p = pred.strip()
    if p in options:
        return p
    for ch in p:
        if ch in options:
            return ch
    hits = [k for k, v in options.items() if v and v.lower() in p.lower()]
    return hits[0] if len(hits) == 1 else ""


def correct(item: TextItem, pred: str) -> bool:
    """OpenCompass's rule for the row: MCQ via :func:`mcq_choice`; QA exact string match (``AccEvaluator``)."""
    if item.options:
        return mcq_choice(pred, item.options) == item.answer
    return pred.strip() == item.answer
