"""A real-shape model as a directory ``vllm serve`` can serve through its chat API: the shapes ``config.json`` plus
the embedded model's tokenizer, chat template and Qwen3-VL processor, no weights (``--load-format dummy``).

Why: the OpenAI chat API needs a tokenizer (the chat template) and, for images, a processor (placeholder
expansion, patches); a shapes model has neither. The text shapes model avoids both (``--skip-tokenizer-init``,
token-id prompts to ``/v1/completions``: :mod:`harness.engines.vllm.shapes`), but images cannot go as token ids.
So the VL shapes model is served with the embedded checkpoint's byte-level tokenizer, **padded with inert entries
up to the real vocabulary** (151,936 for Qwen3-VL-30B-A3B) so that every id the random model can emit decodes,
its special ids written into the config (the tokenizer's, not the real model's numbers), and the real model's
image pixel range (a 448 px image = 28 × 28 patches = 196 LLM tokens; the embedded processor's range, 128² at
most, would shrink it to 16). Used by ``model=qwen3_vl_30b_a3b_shapes engine=vllm load.endpoint=auto`` and by
``benchmarks/bench_vllm_serve.py``.

Text of exact length (:func:`words_of_length`): a ``synthetic_tokens`` part of a request becomes words of this
tokenizer that each encode to one token, so the part is exactly its ``n`` tokens of the prompt (the chat template
and the image placeholders come on top, counted by the server).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

from harness.models.trained import CHECKPOINT as EMBEDDED

#: Qwen3-VL's image processor pixel range (its ``preprocessor_config.json`` ``size``; patch 16, merge 2 as the
#: embedded one): a 448 px image stays 448 px, 28 × 28 patches, 196 visual tokens
QWEN3_VL_IMAGE_SIZE = {"shortest_edge": 65536, "longest_edge": 16777216}

TOKENIZER_NOTE = ("the embedded model's byte-level BPE padded with inert entries to the real vocabulary (chat "
                  "template and Qwen3-VL processor beside it)")


def write_served_model(config: dict[str, Any], directory: str | Path, real_pixel_range: bool = True) -> dict[str, Any]:
    """Write the served directory (module doc) for the shapes ``config`` (text-only or VL); returns the config as
    written (special ids = the tokenizer's, bf16). ``real_pixel_range=False`` keeps the embedded processor's range
    (CPU smoke tests with tiny images)."""
    config = json.loads(json.dumps(config))  # a copy: the ids below are the served tokenizer's
    tok = json.loads((EMBEDDED / "tokenizer.json").read_text())
    special = {t["content"]: int(t["id"]) for t in tok["added_tokens"]}
    text = config.get("text_config", config)
    vocab = int(text["vocab_size"])
    used = set(tok["model"]["vocab"].values()) | set(special.values())
    if max(used) >= vocab:
        raise ValueError(f"vocab_size {vocab} is smaller than the embedded tokenizer ({max(used) + 1})")
    for content, i in special.items():  # the special tokens in the model vocabulary too: the tokenizers library
        tok["model"]["vocab"][content] = i  # otherwise renumbers them after a vocabulary with holes
    for i in range(vocab):  # inert entries: never produced by encoding text, decodable as "<pad_i>"
        if i not in used:
            tok["model"]["vocab"][f"<pad_{i}>"] = i
    text.update(eos_token_id=special["<|im_end|>"], pad_token_id=special["<|endoftext|>"], norm_topk_prob=True)
    vl = "vision_config" in config
    if vl:
        config.update(image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
                      vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"])
    config["torch_dtype"] = "bfloat16"
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "tokenizer.json").write_text(json.dumps(tok))
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(EMBEDDED / name, out / name)
    processor = json.loads((EMBEDDED / "processor_config.json").read_text())
    if vl and real_pixel_range:
        processor["image_processor"]["size"] = dict(QWEN3_VL_IMAGE_SIZE)
    (out / "processor_config.json").write_text(json.dumps(processor, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": text["eos_token_id"]}))
    return config


def one_token_words(tokenizer: Any) -> list[str]:
    """Words of ``tokenizer`` that encode, after a space, to exactly one token (``" word"``): joined with spaces
    they tokenize one token per word, since the pre-tokenizer splits at spaces."""
    out = []
    for i in range(len(tokenizer)):
        piece = tokenizer.decode([i])
        if piece.startswith(" ") and piece[1:].isalpha() and piece[1:].isascii() \
                and tokenizer.encode(piece, add_special_tokens=False) == [i]:
            out.append(piece)
    if not out:
        raise ValueError("the tokenizer has no single-token words")
    return out


def words_of_length(tokenizer: Any, words: list[str], n: int, seed: int) -> str:
    """``n`` words drawn (seeded) from :func:`one_token_words`, checked to encode to exactly ``n`` tokens."""
    rng = random.Random(seed)
    text = "".join(rng.choice(words) for _ in range(int(n)))
    got = len(tokenizer.encode(text, add_special_tokens=False))
    if got != n:
        raise ValueError(f"{n} single-token words encoded to {got} tokens")
    return text
