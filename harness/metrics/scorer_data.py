"""Training and evaluation pairs for the trained scorer encoders, drawn from the synthetic RAG-IGBench generator.

Why a module of its own: the pairs decide what the trained ``clip_score`` and ``alignment`` *mean*, so they are
written once, read by the trainer (:mod:`harness.metrics.scorer_training`) and by the tests, and documented in
docs/scoring.md. Everything comes from :mod:`harness.datasets.synthetic.tasks` (read only) and the scorer's own
context extraction (:func:`harness.metrics.rag_igbench_answer.image_contexts`), never from the embedded VLM.

What the generator allows a scorer to learn, and so what the targets are:

* **CLIP** (``clip_score``: image ↔ the first 25 characters of the text around its tag). The reference answer
  places a note's *text* images right after the note and never a *scene* (shapes) image. A text image's words are
  drawn independently of its note, so no scorer can tell which note a text image belongs to (the edit and Kendall
  scores judge the numbering). The target is what is decidable: an image the reference would place in a note's
  context (a text image) → cosine ≥ :data:`CLIP_POS` (score 1 under the public map 0.1 → 0, 0.4 → 1); a scene
  image in the same context → cosine ≤ :data:`CLIP_NEG` (score 0).
* **Text embedder** (``alignment``: cosine of the model's and the reference's ±20-character contexts of an image
  both place, public map 0.7 → 0, 1 → 1). Target cosine ``0.7 + 0.3·s`` where ``s`` is :func:`content_overlap`,
  the Dice overlap of the two contexts' Chinese character bigrams (markup ignored): alignment ≈ the share of the
  reference's words around the image that the answer reproduces there. Pairs come from simulated answers of the
  kinds the embedded model writes (:func:`perturbed_answer`: clauses with wrong words, images after the wrong
  note, dropped or extra images, another query).
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from harness.metrics.rag_igbench_answer import image_contexts

CLIP_POS = 0.5  # cosine a placeable image must reach (0.4 is score 1)
CLIP_NEG = 0.0  # cosine a scene image must stay under (0.1 is score 0)
CLIP_TEXT_CHARS = 25  # what clip_score reads of a context (rag_igbench.CLIP_TEXT_CHARS)
ALIGN_LO = 0.7  # cosine of alignment 0 (rag_igbench.align_map)

_CJK = re.compile(r"[\u4e00-\u9fff]")
_TAG_CHARS = set("示意图")  # the image tag's alt text ![示意图](IMG#k), also where a window cuts a tag


def content_overlap(a: str, b: str) -> float:
    """Dice overlap of the Chinese character bigrams of two contexts, markup and tag text ignored, in [0, 1].

    Why bigrams of Chinese characters: the synthetic answers' words (query topics, clause heads, aspects and
    endings) are all two or three Chinese characters, and everything else in a context (``**``, ``\\n``, tag
    fragments cut by the ±20-character window, citations) is layout, not content. Two empty contexts agree (1).
    """
    def grams(text: str) -> Counter:
        chars = [c for c in text if _CJK.match(c) and c not in _TAG_CHARS]
        return Counter(zip(chars, chars[1:]))

    ga, gb = grams(a), grams(b)
    total = sum(ga.values()) + sum(gb.values())
    return 1.0 if total == 0 else 2.0 * sum((ga & gb).values()) / total


# ----------------------------------------------------------------------------------------- simulated answers


@dataclass
class Note:
    """One note of an answer: its first clause (head + aspect + ending, 2 + 2 + 3 characters) and its images."""

    clause: str
    images: list[int]


def reference_notes(item: Any) -> list[Note]:
    """The reference answer of a :class:`~harness.datasets.synthetic.tasks.RagItem` as notes (its own rule:
    each note's first clause, then the note's text images in order)."""
    notes, k = [], 0
    for doc, kinds in zip(item.documents, item.kinds):
        ids = []
        for kind in kinds:
            k += 1
            if kind == "text":
                ids.append(k)
        notes.append(Note(doc.split("，")[0], ids))
    return notes


def render(query: str, notes: list[Note]) -> str:
    """An answer in the reference's markdown (``harness.datasets.synthetic.tasks.rag_answer``'s layout)."""
    parts = []
    for i, note in enumerate(notes, start=1):
        parts.append(f"{note.clause}<sup>[{i}](DOC#{i})</sup>。")
        parts += [f"![示意图](IMG#{k})" for k in note.images]
    return f"**{query}**\n\n" + "\n\n".join(parts)


def _other_clause(rng: random.Random, clause: str, n_words: int) -> str:
    """``clause`` with ``n_words`` of its three words (head, aspect, ending) replaced by other generator words."""
    from harness.datasets.synthetic import tasks as st

    words = [clause[:2], clause[2:4], clause[4:]]
    pools = (st.CLAUSE_HEADS, st.CLAUSE_TAILS, st.CLAUSE_ENDS)
    for slot in rng.sample(range(3), n_words):
        words[slot] = rng.choice([w for w in pools[slot] if w != words[slot]])
    return "".join(words)


def perturbed_answer(rng: random.Random, item: Any) -> tuple[str, list[Note]]:
    """(query, notes) of an answer with the mistakes the embedded model makes: clauses with 0-3 wrong words,
    an image moved to another note, dropped, duplicated or replaced by another candidate, another query."""
    from harness.datasets.synthetic import tasks as st

    notes = [Note(n.clause, list(n.images)) for n in reference_notes(item)]
    n_images = sum(len(k) for k in item.kinds)
    for note in notes:
        note.clause = _other_clause(rng, note.clause, rng.choice((0, 0, 1, 2, 3)))
    for _ in range(rng.choice((0, 1, 1, 2))):
        src = rng.choice(notes)
        if not src.images:
            continue
        k = src.images.pop(rng.randrange(len(src.images)))
        action = rng.choice(("move", "drop", "replace", "duplicate"))
        if action == "move":
            rng.choice(notes).images.append(k)
        elif action == "replace":
            src.images.append(rng.randint(1, n_images))
        elif action == "duplicate":
            src.images += [k, k]
    query = item.query
    if rng.random() < 0.5:
        query = rng.choice(st.QUERY_FORMS[item.qtype]).format(a=rng.choice(st.TOPICS), b=rng.choice(st.TOPICS))
    return query, notes


def rag_items(split: str, n: int, seed: int) -> list:
    from harness.datasets.synthetic import tasks as st

    return st.items("rag", split, n, seed)


# ------------------------------------------------------------------------------------------------- pairs


def clip_pairs(items: list, rng: random.Random, variants: int = 2) -> list[tuple[Any, str, int]]:
    """``(image, context[:25], label)``: for each image context of the reference and of ``variants`` perturbed
    answers, the placed image if it is a text image (label 1) and one scene image of the item (label 0), so
    every context is seen with both kinds and only the image decides."""
    out: list[tuple[Any, str, int]] = []
    for item in items:
        flat = [(im, kind) for ims, kinds in zip(item.images, item.kinds) for im, kind in zip(ims, kinds)]
        texts = [im for im, kind in flat if kind == "text"]
        scenes = [im for im, kind in flat if kind == "scene"]
        answers = [item.answer] + [render(*perturbed_answer(rng, item)) for _ in range(variants)]
        for answer in answers:
            for _, ctx in image_contexts(answer):
                ctx = ctx[:CLIP_TEXT_CHARS]
                out.append((rng.choice(texts), ctx, 1))
                if scenes:
                    out.append((rng.choice(scenes), ctx, 0))
    return out


def alignment_pairs(items: list, rng: random.Random, variants: int = 4) -> list[tuple[str, str, float]]:
    """``(model context, reference context, s)`` for every image both answers place, over ``variants``
    perturbed answers per item, the reference against itself, and one reference context of another item
    (unrelated notes: the low end of ``s``)."""
    out: list[tuple[str, str, float]] = []
    refs = [dict(image_contexts(item.answer)) for item in items]
    for i, item in enumerate(items):
        ref = refs[i]
        answers = [item.answer] + [render(*perturbed_answer(rng, item)) for _ in range(variants)]
        for answer in answers:
            pred = dict(image_contexts(answer))
            out += [(pred[k], ref[k], content_overlap(pred[k], ref[k])) for k in pred if k in ref]
        other = refs[rng.randrange(len(items))]
        if ref and other:
            a, b = rng.choice(list(ref.values())), rng.choice(list(other.values()))
            out.append((a, b, content_overlap(a, b)))
    return out


def tokenizer_corpus() -> list[str]:
    """The lines the trained embedder's BPE merges are learnt from: every word the generator writes."""
    from harness.datasets.synthetic import tasks as st

    return st.corpus_lines()
