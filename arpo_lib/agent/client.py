"""The HTTP client of OpenAI-compatible chat servers (vLLM's, ours): urllib only, bounded retries.

`ui_tars_messages` turns a UI-TARS conversation (prompt, screenshots, responses) into OpenAI
chat messages with the screenshots as PNG data URLs; `chat_completion` sends them.
"""
from __future__ import annotations

import base64
import io
import json
import time
import urllib.error
import urllib.request
import weakref
from typing import Any, Sequence

from PIL import Image

from arpo_lib.agent.prompt import DEFAULT_PROMPT, build_messages


class ServerError(RuntimeError):
    """A server could not be reached, started, or did not become healthy, or died."""


class ServerRequestError(RuntimeError):
    """The server answered a request with an error status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


_ENCODED: dict[int, tuple[weakref.ref, str]] = {}
"""The data URL of each live screenshot already encoded, by id() (PIL images are not hashable),
with a weak reference that tells a live image from a new one at a reused id."""


def encode_image(image: Image.Image) -> str:
    """A PNG data URL (lossless, so the server sees exactly these pixels). Each image is encoded
    once while it lives: an episode's request carries up to 15 screenshots, 14 of them sent
    before (a 1080p PNG takes ~0.1 s to compress), so without this a step's request re-encoded
    its whole history. Screenshots are not drawn on once taken (drawings go on copies)."""
    key = id(image)
    cached = _ENCODED.get(key)
    if cached is not None and cached[0]() is image:
        return cached[1]
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")
    _ENCODED[key] = (weakref.ref(image, lambda _, key=key: _forget(key)), url)
    return url


def _forget(key: int) -> None:
    entry = _ENCODED.get(key)
    if entry is not None and entry[0]() is None:  # not a newer image's entry at the same id
        _ENCODED.pop(key, None)


def ui_tars_messages(instruction: str, screenshots: Sequence[Image.Image], responses: Sequence[str],
                     history_images: int = 15, prompt: Any = DEFAULT_PROMPT) -> list[dict[str, Any]]:
    """UI-TARS's prompt (prompt.build_messages) as OpenAI messages, screenshots as data URLs.
    `responses[i]` follows screenshot i; one fewer response than screenshots asks for the next."""
    messages = build_messages(instruction, len(screenshots), list(responses), history_images, prompt)
    kept = list(screenshots[max(0, len(screenshots) - history_images):])
    images = iter(kept)
    out = []
    for msg in messages:
        parts = []
        for part in msg["content"]:
            if part["type"] == "image":
                parts.append({"type": "image_url", "image_url": {"url": encode_image(next(images))}})
            else:
                parts.append(part)
        out.append({"role": msg["role"], "content": parts})
    return out


def chat_completion(
    base_url: str,
    messages: list[dict[str, Any]],
    *,
    model: str,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int = 256,
    seed: int | None = None,
    logprobs: bool = False,
    return_token_ids: bool = False,
    extra_body: dict[str, Any] | None = None,
    api_key: str | None = None,
    timeout_s: float = 30.0,
    retries: int = 2,
    backoff_s: float = 0.5,
) -> dict[str, Any]:
    """POST /chat/completions and return the response JSON.

    `extra_body` adds server-specific fields (vLLM: `structured_outputs`, `logit_bias`, ...).
    `api_key` is sent as a bearer token and nowhere else (never logged or stored).
    Connection failures, timeouts and 503 (server still loading) are retried `retries` times with
    exponential back-off; other HTTP errors raise ServerRequestError with the server's message
    at once (retrying a bad request cannot help)."""
    body: dict[str, Any] = {"model": model, "messages": messages, "temperature": temperature, "top_p": top_p,
                            "max_tokens": max_tokens, "logprobs": logprobs}
    if seed is not None:
        body["seed"] = seed
    if return_token_ids:  # sent only when asked: servers without the extension may reject it
        body["return_token_ids"] = True
    body.update(extra_body or {})
    return post_json(base_url.rstrip("/") + "/chat/completions", body, api_key=api_key, timeout_s=timeout_s,
                     retries=retries, backoff_s=backoff_s)


def post_json(url: str, body: Any, *, api_key: str | None = None, timeout_s: float = 30.0, retries: int = 2,
              backoff_s: float = 0.5) -> Any:
    """POST a JSON body (None: an empty POST) with bounded retries; the decoded JSON answer (None
    for an empty or non-JSON 200 body)."""
    data = json.dumps(body).encode("utf-8") if body is not None else b""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    for attempt in range(retries + 1):
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                raw = resp.read()
            try:
                return json.loads(raw) if raw else None
            except ValueError:
                return None
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", errors="replace")
            try:
                detail = json.loads(detail)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            if exc.code in (401, 403):
                hint = ("the key sent was refused" if api_key else
                        "it wants an API key: name the variable holding it in rollout.api_key_env")
                raise ServerRequestError(f"{url} answered {exc.code} ({hint}): {str(detail)[:500]}", exc.code) from exc
            if exc.code != 503 or attempt == retries:
                raise ServerRequestError(f"{url} answered {exc.code}: {str(detail)[:2000]}", exc.code) from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            # TimeoutError: the server accepted the connection but did not answer in timeout_s.
            if attempt == retries:
                raise ServerError(f"could not reach {url} after {retries + 1} attempts "
                                  f"({timeout_s:g} s timeout each): {exc}") from exc
        time.sleep(backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")
