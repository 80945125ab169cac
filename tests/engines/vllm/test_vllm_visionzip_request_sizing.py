"""VisionZip scope=request in vLLM: the largest image the encoder profile uses is capped so that its bundle fits
``max_model_len`` (``visionzip_request.fitting_image_tokens``). Session 14 on the H200: with Qwen3-VL's real pixel
range (16,384 tokens per image) and an 8,192-token model, keep 0.5's profile bundle needed 8,194 tokens and the
server never started."""

from __future__ import annotations

from functools import partial

from harness.engines.vllm.visionzip_request import fitting_image_tokens
from harness.techniques.visionzip.bundle import request_total


def test_the_session_14_case_is_capped_to_the_largest_bundle_that_fits():
    total = partial(request_total, keep=0.5)
    assert total([16384]) + 2 + 512 > 8192  # what vLLM's uncapped dummy image asked for: refused
    t = fitting_image_tokens(16384, total, 512, 8192)
    assert total([t]) + 2 + 512 <= 8192 < total([t + 1]) + 2 + 512  # the largest that fits
    assert t >= 8192 + 196  # still far more than the 196 tokens of a 448 px image


def test_an_image_that_fits_is_left_alone():
    for keep in (0.5, 0.7, 1.0):
        total = partial(request_total, keep=keep)
        assert fitting_image_tokens(196, total, 512, 8192) == 196
    assert fitting_image_tokens(16384, partial(request_total, keep=1.0), 512, 8192) == 8192 - 2 - 512


def test_nothing_fits_gives_zero():
    assert fitting_image_tokens(100, partial(request_total, keep=0.5), 512, 500) == 0
