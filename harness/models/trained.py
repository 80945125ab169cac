"""The committed trained checkpoint of the embedded model (``model=tiny``, ``run.weights = "trained-synthetic"``).

What it is: the tiny Qwen3-VL-MoE of :mod:`harness.models.tiny` (same architecture and file conventions, a
little larger) trained by ``python -m harness.models.train_tiny`` on the project's synthetic task suite
(:mod:`harness.datasets.synthetic.tasks`). It reads short capital/digit text lines, answers shape questions
and writes RAG-IGBench JSON answers for *that suite*: a machinery-level model whose scores move when a
technique costs quality, never a real model's quality.

``CHECKPOINT`` lives inside the package (``pyproject`` package-data), so a wheel carries it; its
``harness_model.json`` records the training configuration, the data-generator version, the final losses and
the SHA-256 of ``model.safetensors``, which :func:`trained_checkpoint` checks before anything loads it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from harness.models.tiny import MARKER, TinyModelSpec

WEIGHTS_LABEL = "trained-synthetic"
CHECKPOINT = Path(__file__).parent / "checkpoints" / "tiny-trained-synthetic"
#: the files of a committed checkpoint directory (both engines load them; train_log.jsonl rides along, not loaded)
CHECKPOINT_FILES = ("model.safetensors", "config.json", "harness_model.json", "tokenizer.json", "tokenizer_config.json",
                    "chat_template.jinja", "processor_config.json")

# The trained model's shape: ~4 M parameters (≈17 MB float32) — room for OCR in the vision tower and for
# 16 experts × top-4 in 4 MoE layers, still a few-second CPU run. hidden 128 ≠ 2 × 96 (layout check).
TRAINED_SPEC = TinyModelSpec(
    seed=0, vocab_size=2048, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96, initializer_range=0.02,
    vision_depth=4, vision_hidden_size=96, vision_num_heads=3, vision_intermediate_size=192,
    deepstack_visual_indexes=(1, 2), corpus="tasks",
)


class CheckpointError(RuntimeError):
    """The committed checkpoint is missing or its weights do not match the recorded SHA-256."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_info(path: Path = CHECKPOINT) -> dict:
    """The checkpoint's ``harness_model.json`` (training config, generator version, losses, SHA-256)."""
    try:
        return json.loads((path / MARKER).read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"trained checkpoint not found at {path} ({e}); "
                              "`python -m harness.models.train_tiny --out DIR` trains one") from e


def trained_checkpoint(path: Path = CHECKPOINT) -> tuple[Path, dict]:
    """``(directory, info)`` of the trained checkpoint after checking ``model.safetensors`` against its SHA-256
    (a corrupt or half-copied file fails here, not as silently wrong answers)."""
    info = checkpoint_info(path)
    digest = sha256_file(path / "model.safetensors")
    if digest != info.get("sha256"):
        raise CheckpointError(f"{path / 'model.safetensors'}: SHA-256 {digest} does not match the recorded "
                              f"{info.get('sha256')}")
    return path, info
