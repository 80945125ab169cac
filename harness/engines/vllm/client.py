"""The harness's requests as OpenAI chat completions, streamed from a ``vllm serve`` and timed as
``vllm bench serve`` times them.

**Request** (:func:`chat_messages`, :func:`chat_payload`): one user message whose content parts are the
request's own, in order — ``{"type": "text"}`` and ``{"type": "image_url"}`` with the image as a PNG data
URL (lossless: the server decodes the same pixels the offline engine hands vLLM; ``load.image_format=jpeg`` sends
JPEG, as production clients do: smaller and cheaper to decode, lossy); the server applies the
checkpoint's chat template to it, as the offline engine does with ``apply_chat_template``. Greedy as
offline: ``temperature=0``, ``max_completion_tokens`` = ``generation.max_new_tokens``, ``seed``
(``generation.do_sample=true``: ``temperature=1`` and one seed per request — what a load test of a random-weight
model needs, whose greedy outputs collapse onto one token cycle: docs/vllm.md),
``repetition_penalty=1`` (explicit, so a checkpoint ``generation_config.json`` cannot change the decoding
of a server started without ``--generation-config vllm``), ``stream=true`` with
``stream_options.include_usage`` (the server's token counts) and vLLM's ``return_token_ids`` (the prompt's
ids in the first chunk, each chunk's delta ids: answers are decoded from the ids exactly as offline, visual
tokens counted in the expanded prompt).

**Timing** (:func:`stream_chat`) is ``vllm bench serve``'s ``async_request_openai_chat_completions``
(vLLM 0.32): ``sent`` = ``perf_counter()`` just before the POST; every SSE ``data:`` message that has
``choices`` is a chunk, stamped when parsed (the first one, vLLM's role chunk, sent when the first token
is out, gives TTFT; the usage message has no choices and is no chunk); ``output_tokens`` =
``usage.completion_tokens``. :func:`harness.engines.vllm.load.drive_load` turns these into TTFT, ITL, E2E
and TPOT = (E2E − TTFT)/(output tokens − 1), as ``vllm bench serve``'s ``calculate_metrics`` does. So the
ITL list has one entry per chunk after the first, the gap between the role chunk and the first content
chunk included — ``vllm bench serve``'s convention. The HTTP client is aiohttp (a vLLM dependency).

**Key**: a server with an API key (``--api-key`` / ``VLLM_API_KEY``) answers only requests that carry it as
``Authorization: Bearer <key>`` — vLLM's ``/v1`` routes and the harness's ``/harness`` ones alike
(:mod:`harness.engines.vllm.endpoint_guard`); :func:`auth_headers` is that header, for every request the
harness sends.
"""

from __future__ import annotations

import base64
import io
import json
import time
from typing import Any, Callable

from harness.engines.base import Request


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that proves the request comes from whoever holds the server's key (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


IMAGE_FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg")}


def image_url(image: Any, image_format: str = "png", jpeg_quality: int = 90) -> str:
    """A PIL image as a data URL (RGB, as the offline engine converts it). PNG (the default) is lossless: the
    server decodes the offline engine's pixels. JPEG (``load.image_format=jpeg``) is what production clients send:
    for a photo a fraction of PNG's bytes and of its decode time on the server, at the cost of other pixels."""
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"image_format {image_format!r}: one of {sorted(IMAGE_FORMATS)}")
    pil_format, mime = IMAGE_FORMATS[image_format]
    if getattr(image, "mode", "RGB") != "RGB":
        image = image.convert("RGB")
    buf = io.BytesIO()
    image.save(buf, format=pil_format, **({"quality": int(jpeg_quality)} if pil_format == "JPEG" else {}))
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def chat_messages(request: Request, image_format: str = "png", jpeg_quality: int = 90,
                  synthetic_text: Callable[[dict[str, Any]], str] | None = None) -> list[dict[str, Any]]:
    """The request as one user message: its text and image parts in order (images in ``request.images``,
    one per image part, as the offline engine pairs them), each image a data URL (:func:`image_url`).
    ``synthetic_text``: how a ``synthetic_tokens`` part becomes text (a served shapes model,
    :meth:`harness.engines.vllm.shapes.VllmShapes.chat_text`); without it such a part is refused."""
    images = iter(request.images or [])
    parts: list[dict[str, Any]] = []
    for part in request.content:
        kind = part["type"]
        if kind == "text":
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            url = image_url(next(images), image_format, jpeg_quality)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "synthetic_tokens" and synthetic_text is not None:
            parts.append({"type": "text", "text": synthetic_text(part)})
        else:
            raise ValueError(f"request {request.uid}: a {kind!r} part cannot go to the chat API")
    return [{"role": "user", "content": parts}]


def sample_seed(seed: int, index: int) -> int:
    """Request ``index``'s sampling seed under run seed ``seed``: distinct per request, the same on a re-run."""
    return (int(seed) * 1_000_003 + int(index)) % (2**31 - 1)


def chat_payload(model: str, messages: list[dict[str, Any]], max_tokens: int, seed: int,
                 temperature: float = 0.0) -> dict[str, Any]:
    """Greedy by default; ``temperature`` > 0 samples with ``seed`` (the load client gives each request its own,
    so that sampled requests do not draw the same tokens)."""
    return {"model": model, "messages": messages, "max_completion_tokens": int(max_tokens),
            "temperature": float(temperature),
            "seed": int(seed), "repetition_penalty": 1.0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}


def completion_payload(model: str, prompt_ids: list[int], max_tokens: int, seed: int,
                       temperature: float = 0.0) -> dict[str, Any]:
    """A real-shape model's request (``model=<arch>_shapes``): its exact prompt ids to ``/v1/completions``, which
    takes a token-id prompt as it is — no chat template, no tokenizer on the server (``--skip-tokenizer-init``) —
    so the server prefills exactly the ids the in-process engines prefill. The same sampling fields and stream
    options as :func:`chat_payload`."""
    return {"model": model, "prompt": [int(i) for i in prompt_ids], "max_tokens": int(max_tokens),
            "temperature": float(temperature), "seed": int(seed), "repetition_penalty": 1.0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}


async def stream_chat(session: Any, url: str, payload: dict[str, Any]) -> dict[str, Any]:
    """POST ``payload`` to ``url`` (``…/v1/chat/completions``, or ``…/v1/completions`` for a token-id prompt:
    its chunks carry ``text`` and their ``prompt_token_ids`` in the choice) and read the stream (module doc). Returns
    ``{"sent", "chunks", "ids", "prompt_ids", "text", "finish_reason", "output_tokens", "prompt_tokens"}``;
    raises on an HTTP error (its body in the message)."""
    chunks: list[float] = []
    ids: list[int] = []
    prompt_ids: list[int] = []
    text: list[str] = []
    finish = None
    usage: dict[str, Any] = {}
    sent = time.perf_counter()
    async with session.post(url, json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status} from {url}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.decode("utf-8").strip()
            if not line or line.startswith(":") or not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter()
            msg = json.loads(data)
            if msg.get("prompt_token_ids"):
                prompt_ids = list(msg["prompt_token_ids"])
            if choices := msg.get("choices"):
                chunks.append(now)
                choice = choices[0]
                if choice.get("prompt_token_ids"):  # the completions API puts them in the first choice
                    prompt_ids = list(choice["prompt_token_ids"])
                ids.extend(choice.get("token_ids") or [])
                text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
            elif msg.get("usage"):
                usage = msg["usage"]
    return {"sent": sent, "chunks": chunks, "ids": ids, "prompt_ids": prompt_ids, "text": "".join(text),
            "finish_reason": finish, "output_tokens": usage.get("completion_tokens"),
            "prompt_tokens": usage.get("prompt_tokens")}
