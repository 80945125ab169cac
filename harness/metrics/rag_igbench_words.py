"""The words RAG-IGBench's Rouge-1 counts: jieba's segmentation of a text minus a Chinese stopword list, split
further as the ``rouge`` package splits.

The public scorer (zry13/RAG-IGBench ``score/eval.py``, ``remove_stopwords``) cuts a text into jieba words, drops
those in its stopword list, joins the rest with spaces and hands them to the ``rouge`` package, which splits
sentences at ``.`` and words at whitespace; :func:`words` reproduces that chain, and
:func:`harness.metrics.rag_igbench.rouge1` compares its output. The stopword list is ``scoring.stopwords``
(:func:`resolve_stopwords`, :data:`STOPWORD_CHOICES`): by default the public scorer's own list
(:data:`PUBLIC_STOPWORDS`, shipped byte for byte, so Rouge-1 is the public Rouge-1), or the project's list
(:data:`PROJECT_STOPWORDS`), none, or a file.

Why a module of its own: which words count is a different job from scoring them, with its own material — two
shipped stopword files, their provenance, the rule by which each is read, jieba's one-time set-up — and a user
besides Rouge-1: :mod:`harness.metrics.scoring` resolves ``scoring.stopwords`` once per run, so a missing file
fails before any sample is scored. Rouge-1's F1 and the other scores stay in :mod:`harness.metrics.rag_igbench`.

Where this departs from the public scorer: only by option. The default list is the public one, read as the public
scorer reads it (every line verbatim, a space and the two characters ``\\n`` included);
``scoring.stopwords=project``, ``none`` or a path choose another list, and Rouge-1 with it departs from the
public figure (``summary.json`` ``run.scoring.stopwords`` records the choice). A list other than the public one
skips lines starting with ``"# "`` (comments). As in the public scorer, no case folding or width normalisation.

Only the standard library is imported at module level; jieba is imported on first use.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Collection

_HERE = os.path.dirname(os.path.abspath(__file__))
#: The public scorer's stopword list, ``score/cn_stopwords.txt`` of zry13/RAG-IGBench, byte for byte
#: (Apache-2.0; NOTICE_cn_stopwords_public.txt): 752 distinct lines (the common ``cn_stopwords.txt`` list plus a few
#: punctuation lines, a space and the two characters ``\n``), read as the public scorer reads it
#: — ``set(text.splitlines())``, every line verbatim. The default, so Rouge-1 is the public Rouge-1.
PUBLIC_STOPWORDS = os.path.join(_HERE, "cn_stopwords_public.txt")
#: The project's own list (``scoring.stopwords=project``), written for this project: ASCII and full-width
#: punctuation, digits, pronouns, demonstratives, question words, particles, conjunctions, prepositions,
#: adverbs and light verbs (448 entries; lines starting with ``"# "`` are comments). Rouge-1 with it departs
#: from the public figure (different words removed).
PROJECT_STOPWORDS = os.path.join(_HERE, "cn_stopwords.txt")
#: The list used when none is named.
DEFAULT_STOPWORDS = PUBLIC_STOPWORDS
#: ``scoring.stopwords`` values besides a file path: ``public`` = :data:`PUBLIC_STOPWORDS` (default),
#: ``project`` = :data:`PROJECT_STOPWORDS`, ``none`` = no stopword is removed.
STOPWORD_CHOICES = ("public", "project", "none")


def resolve_stopwords(choice: str | os.PathLike | None) -> frozenset[str]:
    """The stopword set of ``scoring.stopwords``: ``public`` (or None) = the public scorer's list,
    ``project`` = the project's list, ``none`` = the empty set, anything else = a file path (UTF-8, one word
    per line). A missing file raises ``FileNotFoundError``."""
    if choice is None or str(choice) == "public":
        return load_stopwords(PUBLIC_STOPWORDS)
    if str(choice) == "project":
        return load_stopwords(PROJECT_STOPWORDS)
    if str(choice) == "none":
        return frozenset()
    path = os.fspath(choice)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"scoring.stopwords={path!r}: no such file (expected public, project, none or "
                                "the path of a stopword list, one word per line)")
    return load_stopwords(path)


# ------------------------------------------------------------------------------------------------- words

_jieba_lock = threading.Lock()
_jieba_module = None


def _jieba():
    """jieba, initialised once with its start-up messages silenced."""
    global _jieba_module
    with _jieba_lock:
        if _jieba_module is None:
            import jieba

            jieba.setLogLevel(logging.WARNING)
            jieba.initialize()
            _jieba_module = jieba
    return _jieba_module


@functools.lru_cache(maxsize=8)
def _read_stopwords(path: str) -> frozenset[str]:
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    if os.path.abspath(path) == PUBLIC_STOPWORDS:  # verbatim, as the public scorer reads it
        return frozenset(lines)
    return frozenset(w for w in lines if not w.startswith("# "))


def load_stopwords(stopwords: str | os.PathLike | Collection[str] | None = None) -> frozenset[str]:
    """A stopword set from a file (one word per line, read once; lines starting with ``"# "`` are comments,
    except in the public list, read verbatim) or a collection; None = :data:`DEFAULT_STOPWORDS` (the public
    list)."""
    if stopwords is None or isinstance(stopwords, (str, os.PathLike)):
        return _read_stopwords(os.fspath(stopwords or DEFAULT_STOPWORDS))
    return frozenset(stopwords)


def words(text: str | None, stopwords: str | os.PathLike | Collection[str] | None = None) -> list[str]:
    """jieba words of ``text`` that are not stopwords, split further at ``.`` and whitespace.

    The reference joins the kept jieba words with spaces and hands them to the ``rouge`` package, which
    splits sentences at ``.`` and words at whitespace; the second split reproduces that (``3.5`` → ``3``,
    ``5``; whitespace tokens vanish). No case folding or width normalisation (``Ａ`` ≠ ``A``), as there.
    """
    if not isinstance(text, str) or not text:
        return []
    stop = load_stopwords(stopwords)
    return [p for w in _jieba().lcut(text) if w not in stop for p in w.replace(".", " ").split()]


class WordTokenizer:
    """rouge_score tokenizer interface over :func:`words`."""

    def __init__(self, stopwords):
        self.stopwords = stopwords

    def tokenize(self, text: str) -> list[str]:
        return words(text, self.stopwords)
