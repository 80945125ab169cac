"""Synthetic data in the real formats: the tasks the embedded model is trained and scored on (``tasks``), a
RAG-IGBench-format sample (``rag_igbench``), OCRBench/CCBench-format rows (``ocr_cc``) and the bundle command
that writes the committed samples (``bundle``).
"""

from harness import _moved as _moved


def __getattr__(name: str):  # the old module harness.datasets.synthetic (before issue 24's folder moves): its names, for one release
    return _moved.forward_attribute(__name__, name, ('bundle', 'ocr_cc', 'rag_igbench', 'tasks'))
