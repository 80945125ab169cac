"""VisionZip's statistics (``harness.techniques.visionzip.stats``): the per-source keep rate a run reports in
``summary.json`` (``visionzip.by_source``) is token-weighted per source, with the per-image mean beside it, and
refuses per-image lists that disagree. Plain Python: no model, no torch."""

from __future__ import annotations

import pytest

from harness.techniques.visionzip.stats import keep_rate_by_source


def test_keep_rate_by_source():
    out = keep_rate_by_source([(["ocr", "cc"], [16, 4], [12, 1]), (["cc"], [8], [4])])
    assert out["ocr"] == {"images": 1, "visual_tokens_before": 16, "visual_tokens_after": 12, "keep_rate": 0.75,
                          "mean_image_keep_rate": 0.75}
    assert out["cc"]["visual_tokens_before"] == 12 and out["cc"]["visual_tokens_after"] == 5
    assert out["cc"]["keep_rate"] == 5 / 12 and out["cc"]["mean_image_keep_rate"] == (0.25 + 0.5) / 2
    with pytest.raises(ValueError):
        keep_rate_by_source([(["a"], [1, 2], [1, 1])])
