"""``benchmarks/vl_frontend_cost.py`` times the server-side CPU stages of a multi-image request; this checks that the
stages it times are the ones the harness client's payload needs (the data URLs decode back to the images, the
processor yields the planned visual tokens) and that the result file records what a reader needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_frontend_cost_runs_and_counts_the_planned_visual_tokens(tmp_path: Path) -> None:
    out = tmp_path / "cost"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vl_frontend_cost.py"), "--images", "2", "--px", "448",
                    "--repeats", "2", "--variants", "noise:png,photo:jpeg", "--out", str(out)], check=True, cwd=ROOT,
                   capture_output=True, timeout=300)
    result = json.loads(out.with_suffix(".json").read_text())
    # 448 px under Qwen3-VL's pixel range, patch 16, merge 2: 28 x 28 patches -> 196 visual tokens per image, the
    # count the serving benchmark plans for (a smaller image would be scaled *up* to the range's minimum)
    assert result["visual_tokens"] == 2 * 196
    assert list(result["variants"]) == ["noise:png", "photo:jpeg"]
    for r in result["variants"].values():
        assert r["payload_MiB_per_request"] > 0
        for stage in ("json_ms", "decode_ms", "processor_ms", "total_ms"):
            low, high = r[stage]["spread"]
            assert low <= r[stage]["median"] <= high and r[stage]["ci"] is not None
        assert r["total_ms"]["median"] >= r["decode_ms"]["median"]
    # a photo-like image as JPEG is a fraction of random pixels as PNG (which no codec compresses): the bytes the
    # server reads and decodes, whatever the machine's speed
    v = result["variants"]
    assert v["photo:jpeg"]["payload_MiB_per_request"] < 0.2 * v["noise:png"]["payload_MiB_per_request"]
    assert {"torch", "transformers", "torch_threads", "cpu_count"} <= result.keys()
