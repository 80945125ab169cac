"""Who may use the harness's ``/harness/*`` routes on ``vllm serve``, and how a reset must be asked for.

Why (issue 26): the routes had no authentication, and ``vllm serve --api-key`` guards ``/v1`` only (vLLM's
``AuthenticationMiddleware`` skips every other path). Anyone who could reach the server — another user of a
shared node, or a web page in a browser on it (vLLM allows every CORS origin by default) — could send a bodiless
``POST /harness/stats?reset=true`` and clear every worker's SERE / ``moe.top_k`` counters in the middle of a
measurement. The rules here, applied by :class:`harness.engines.vllm.endpoint.HarnessEndpoint` to every
``/harness`` request:

1. **key** — when the server has an API key (:func:`server_keys`: vLLM's own rule, ``--api-key`` else
   ``VLLM_API_KEY``), a request must carry ``Authorization: Bearer <key>`` (401 otherwise; compared in constant
   time);
2. **not from a web page of another site** — a request whose ``Origin`` is not the server itself, or whose
   ``Sec-Fetch-Site`` is ``cross-site`` / ``same-site``, is refused (403): the harness's own client (urllib,
   aiohttp) sends neither header, a browser always sends ``Origin`` on a cross-origin ``fetch``;
3. **an explicit reset** — ``POST /harness/stats`` resets only with the JSON body ``{"reset": true}`` sent as
   ``Content-Type: application/json`` (a type no CORS-simple request can have, so a cross-site form cannot
   send it without a preflight). A bodiless POST reads without resetting; a ``reset`` in the query string is
   refused (400) rather than ignored, so an old client learns why its reset did not happen; another content
   type is refused (415).

Pure functions on plain mappings (no FastAPI): tested in the main venv.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

API_KEY_ENV = "VLLM_API_KEY"
RESET_BODY = '{"reset": true}'


class Refused(Exception):
    """A request the endpoint answers with ``status`` and ``detail`` instead of doing anything."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def server_keys(args: Any, env: Mapping[str, str] | None = None) -> list[str]:
    """The keys the server accepts, as vLLM decides them: ``--api-key`` (a string, or a list where vLLM
    accepts several), else the ``VLLM_API_KEY`` environment variable; empty values are no key."""
    env = os.environ if env is None else env
    given = getattr(args, "api_key", None)
    keys = [given] if isinstance(given, str) else list(given or [])
    keys = [k for k in keys if isinstance(k, str) and k]
    return keys or ([env[API_KEY_ENV]] if env.get(API_KEY_ENV) else [])


def _lower(headers: Mapping[str, str]) -> dict[str, str]:
    return {str(k).lower(): str(v) for k, v in headers.items()}


def check_key(headers: Mapping[str, str], keys: Sequence[str]) -> None:
    """Rule 1: with keys, the request must carry one of them as a bearer token."""
    if not keys:
        return
    scheme, _, token = _lower(headers).get("authorization", "").partition(" ")
    token_b = token.strip().encode()
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token_b, k.encode()) for k in keys):
        raise Refused(401, "the /harness routes need the server's API key: Authorization: Bearer <key> "
                           "(the key vllm serve was started with: --api-key or VLLM_API_KEY)")


def check_same_origin(headers: Mapping[str, str]) -> None:
    """Rule 2: refuse what a browser sends on behalf of a page of another site."""
    h = _lower(headers)
    site = h.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise Refused(403, f"cross-site request refused (Sec-Fetch-Site: {site})")
    origin = h.get("origin")
    if origin is not None and (origin == "null" or urlsplit(origin).netloc.lower() != h.get("host", "").lower()):
        raise Refused(403, f"cross-origin request refused (Origin: {origin})")


def guard(headers: Mapping[str, str], keys: Sequence[str]) -> None:
    """Rules 1 and 2, for every ``/harness`` request."""
    check_key(headers, keys)
    check_same_origin(headers)


def stats_reset(headers: Mapping[str, str], query: Mapping[str, str], body: bytes) -> bool:
    """Rule 3: whether ``POST /harness/stats`` asks for a reset (raises :class:`Refused` for a request that
    asks the wrong way)."""
    if "reset" in query:
        raise Refused(400, f"reset goes in the JSON body {RESET_BODY} (Content-Type: application/json), "
                           "not in the query string")
    if not body.strip():
        return False
    ctype = _lower(headers).get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype != "application/json":
        raise Refused(415, f"POST /harness/stats takes Content-Type: application/json, not {ctype or 'none'!r}")
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise Refused(400, f"the body is not JSON ({e}); send {RESET_BODY} or {{\"reset\": false}}") from e
    if not isinstance(payload, dict) or set(payload) - {"reset"}:
        raise Refused(400, f"the body must be an object with only a 'reset' key, e.g. {RESET_BODY}")
    reset = payload.get("reset", False)
    if not isinstance(reset, bool):
        raise Refused(400, f"'reset' must be true or false, got {reset!r}")
    return reset
