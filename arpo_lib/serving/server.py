"""Our OpenAI-compatible chat-completions server around the in-process `HFPolicy`.

`python -m arpo_lib.serving.server --model DIR --port P` (or `launch.start_server(backend="hf")`):
a small server on the standard library's `ThreadingHTTPServer`. It exists so the rest of the
workbench (evaluation, the "GPU inference server" notebook) can speak one protocol whether the
model runs here with transformers or in vLLM. Departures from OpenAI: `n` must be 1, image URLs
must be `data:` URLs (the server never fetches anything), `top_logprobs` are not computed, and
with `logprobs` or `return_token_ids` (vLLM's extension) true the response carries
`choices[0].token_ids`, as vLLM's does: the sampled ids, which token-exact training needs.

Request parsing and the backend hold no HTTP, so both are testable in-process.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import io
import json
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence

from PIL import Image

from arpo_lib.types import SamplingParams, Segment

MAX_BODY_BYTES = 256 * 1024 * 1024


class RequestError(ValueError):
    """A request the server refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class ChatRequest:
    """A validated chat-completions request, images decoded."""

    messages: list[dict[str, Any]]
    """Messages in the Hugging Face chat-template format: parts {type: text} / {type: image}."""
    images: list[Image.Image]
    """The images in the order of their placeholders."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    seed: int | None = None
    logprobs: bool = False
    return_token_ids: bool = False
    """vLLM's extension (also implied by logprobs here): the sampled ids in choices[0].token_ids."""
    frequency_penalty: float = 0.0
    """OpenAI's: each token's logit lowered by this times its count in the response so far."""
    skip_special_tokens: bool = True
    """vLLM's sampling field: drop special tokens (Qwen's box markers among them) from the text."""


def decode_data_url(url: str) -> Image.Image:
    """An RGB PIL image from a `data:image/...;base64,...` URL. Anything else is refused: the
    server must never fetch a URL or read a path on behalf of a client."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise RequestError("only data: image URLs are accepted (the server does not fetch URLs)", param="messages")
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise RequestError("image data URL must look like data:image/<type>;base64,<data>", param="messages")
    try:
        raw = base64.b64decode(payload, validate=True)
        image = Image.open(io.BytesIO(raw))
        return image.convert("RGB")
    except (binascii.Error, ValueError, OSError) as exc:
        raise RequestError(f"could not decode the image: {exc}", param="messages") from exc


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise RequestError(f"'{key}' must be a number in [{lo}, {hi}]", param=key)
    return float(value)


def _optional_int(body: dict[str, Any], key: str, lo: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise RequestError(f"'{key}' must be an integer >= {lo}", param=key)
    return value


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate an OpenAI chat-completions body and convert its messages to the chat-template
    format (images become placeholders, decoded into `images`). Raises RequestError (400)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    if body.get("n", 1) != 1:
        raise RequestError("only n=1 is supported", param="n")
    if body.get("stream"):
        raise RequestError("streaming is not supported", param="stream")
    messages: list[dict[str, Any]] = []
    images: list[Image.Image] = []
    for i, msg in enumerate(raw_messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant"):
            raise RequestError(f"messages[{i}] needs a role of system, user or assistant", param="messages")
        content = msg.get("content")
        if isinstance(content, str):
            # One text part renders exactly like a plain string in the Qwen-VL templates, and the
            # list form is what the rest of the workbench (prompt.build_messages) uses.
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image_url":
                    ref = part.get("image_url")
                    url = ref.get("url") if isinstance(ref, dict) else ref
                    images.append(decode_data_url(url))
                    parts.append({"type": "image"})
                else:
                    raise RequestError(f"messages[{i}] has a content part that is neither text nor image_url",
                                       param="messages")
        else:
            raise RequestError(f"messages[{i}].content must be a string or a list of parts", param="messages")
        messages.append({"role": msg["role"], "content": parts})
    if body.get("structured_outputs") or body.get("guided_regex") or body.get("response_format"):
        raise RequestError("constrained decoding (structured_outputs) needs the vllm backend", param="structured_outputs")
    for key, neutral in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("min_p", 0.0)):
        if key in body and body[key] != neutral:
            raise RequestError(f"'{key}' {body[key]!r} is not supported by the hf server (only {neutral})", param=key)
    if body.get("top_k") not in (None, -1, 0):
        raise RequestError("'top_k' is not supported by the hf server (only -1 or 0: off)", param="top_k")
    flags = {key: body.get(key, default) for key, default in
             (("logprobs", False), ("return_token_ids", False), ("skip_special_tokens", True))}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise RequestError(f"'{key}' must be true or false", param=key)
    return ChatRequest(
        messages=messages, images=images,
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        max_tokens=_optional_int(body, "max_tokens", 1) or _optional_int(body, "max_completion_tokens", 1),
        seed=_optional_int(body, "seed", 0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        **flags,
    )


def encode_prompt(processor: Any, messages: list[dict[str, Any]], images: Sequence[Image.Image]) -> Segment:
    """The generation prompt as a Segment: the processor's chat template with the assistant
    header opened, tokenized together with the images (pixels split per image, as
    TokenConversation stores them)."""
    import torch

    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = processor(text=[text], images=list(images) or None, return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    mm = enc.get("mm_token_type_ids")
    seg = Segment()
    seg.extend(ids, mm[0].tolist() if mm is not None else [0] * len(ids), mask=0)
    if images:
        grids = enc["image_grid_thw"]
        sizes = [int(torch.prod(g)) for g in grids]
        for chunk, grid in zip(torch.split(enc["pixel_values"], sizes), grids):
            seg.pixel_values.append(chunk)
            seg.image_grid_thw.append(grid)
    return seg


class HFChatBackend:
    """Chat completions from an `HFPolicy`, one request at a time (one model, one lock)."""

    def __init__(self, policy: Any, max_new_tokens: int = 256):
        self.policy = policy
        self.max_new_tokens = max_new_tokens
        self.lock = threading.Lock()

    def complete(self, request: ChatRequest, model_name: str) -> dict[str, Any]:
        """The OpenAI chat.completion response for a validated request."""
        segment = encode_prompt(self.policy.processor, request.messages, request.images)
        with self.lock:
            # A seeded request samples with its own generator (HFPolicy's per-row seeds), so its
            # answer does not depend on what other requests drew before it.
            sampling = SamplingParams(temperature=request.temperature, top_p=request.top_p,
                                      max_new_tokens=request.max_tokens or self.max_new_tokens,
                                      frequency_penalty=request.frequency_penalty)
            gen = self.policy.generate([segment], sampling=sampling,
                                       seeds=None if request.seed is None else [request.seed])[0]
        finished = bool(gen.token_ids) and gen.token_ids[-1] in self.policy.eos_ids
        text = gen.text if not request.skip_special_tokens else \
            self.policy.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": "stop" if finished else "length",
            "logprobs": None,
        }
        if request.logprobs:
            tokenizer = self.policy.tokenizer
            content = []
            for tok, lp in zip(gen.token_ids, gen.logprobs):
                piece = tokenizer.decode([tok])
                content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")),
                                "top_logprobs": []})
            choice["logprobs"] = {"content": content}
        if request.logprobs or request.return_token_ids:
            choice["token_ids"] = list(gen.token_ids)
        response = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [choice],
            "usage": {"prompt_tokens": len(segment), "completion_tokens": len(gen.token_ids),
                      "total_tokens": len(segment) + len(gen.token_ids)},
        }
        if request.return_token_ids:  # as vLLM: the prompt as the model saw it, images expanded
            response["prompt_token_ids"] = list(segment.input_ids)
        return response


# -- HTTP plumbing ---------------------------------------------------------------------------
class ChatServer(ThreadingHTTPServer):
    """The HTTP server; `backend` is None until the model has loaded (/health answers 503)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], served_model_name: str, api_key: str | None = None):
        super().__init__(address, ChatHandler)
        self.served_model_name = served_model_name
        self.api_key = api_key
        """When set, every /v1/* request must carry `Authorization: Bearer <api_key>` (as vLLM's
        --api-key: /health stays open for launchers and load balancers)."""
        self.backend: HFChatBackend | None = None
        self.last_health_status: int | None = None


def _error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             503: "service_unavailable"}
    kind = kinds.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class ChatHandler(BaseHTTPRequestHandler):
    """Routes: GET /health, GET /v1/models, POST /v1/chat/completions."""

    server: ChatServer
    protocol_version = "HTTP/1.1"

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # one line per request comes from _send, with the duration

    def _send(self, status: int, payload: Any, note: str = "") -> None:
        body = (payload if isinstance(payload, str) else json.dumps(payload)).encode("utf-8")
        self.send_response(status)
        kind = "text/plain; charset=utf-8" if isinstance(payload, str) else "application/json"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if self.path == "/health":
            # A launcher polls /health every fraction of a second while the model loads: log
            # only when its answer changes, not every poll.
            if self.server.last_health_status == status:
                return
            self.server.last_health_status = status
        took = time.monotonic() - getattr(self, "_started", time.monotonic())
        sys.stderr.write(f"{time.strftime('%H:%M:%S')} {self.command} {self.path} {status} {took:.2f}s {note}\n")
        sys.stderr.flush()

    def _authorized(self) -> bool:
        """Check the bearer token on /v1/*; answer 401 and return False when it is missing or wrong."""
        key = self.server.api_key
        if key is None or not self.path.startswith("/v1"):
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {key}".encode()):
            return True
        self.close_connection = True  # the body (if any) is not read
        self._send(401, _error_body("missing or wrong API key (send `Authorization: Bearer <key>`)", 401))
        return False

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._started = time.monotonic()
        if not self._authorized():
            return
        if self.path == "/health":
            if self.server.backend is None:
                self._send(503, "loading")
            else:
                self._send(200, "ok")
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{
                "id": self.server.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "arpo"}]})
        else:
            self._send(404, _error_body(f"no route {self.path}", 404))

    def do_POST(self) -> None:  # noqa: N802
        self._started = time.monotonic()
        if not self._authorized():
            return
        if self.path != "/v1/chat/completions":
            self._send(404, _error_body(f"no route {self.path}", 404))
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY_BYTES:
                raise RequestError(f"a JSON body of 1 to {MAX_BODY_BYTES} bytes is required (Content-Length)")
            try:
                body = json.loads(self.rfile.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise RequestError(f"the body is not valid JSON: {exc}") from exc
            request = parse_chat_request(body)
            backend = self.server.backend
            if backend is None:
                raise RequestError("the model is still loading", status=503)
            response = backend.complete(request, self.server.served_model_name)
        except RequestError as exc:
            self._send(exc.status, _error_body(str(exc), exc.status, exc.param), note=str(exc))
            return
        except Exception as exc:  # a failure inside generation must not kill the server
            self._send(500, _error_body(f"{type(exc).__name__}: {exc}", 500), note=repr(exc))
            return
        usage = response["usage"]
        self._send(200, response, note=f"images={len(request.images)} prompt={usage['prompt_tokens']} "
                                       f"completion={usage['completion_tokens']}")


def serve(model: str, *, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None,
          device: str = "auto", dtype: str = "auto", max_new_tokens: int = 256, threads: int | None = None,
          api_key: str | None = None) -> None:
    """Bind, load the model (while /health answers 503), then serve until SIGTERM/SIGINT.

    `api_key`: required on /v1/* when set; a host other than loopback refuses to start without one.

    Binding first reserves the port and lets a launcher tell "loading" from "dead"; a failed load
    exits non-zero with the reason in the log.
    """
    import torch

    from arpo_lib.agent.hf_policy import HFPolicy

    if threads:
        torch.set_num_threads(threads)
    # SIGTERM (what ServerHandle.stop sends) unwinds like Ctrl-C, so the socket is closed cleanly.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from arpo_lib.run.net import is_loopback, weak_key_reason
    from arpo_lib.serving.launch import UnprotectedServerError

    if not is_loopback(host) and not api_key:
        raise UnprotectedServerError(f"refusing to listen on {host!r} without an API key (--api-key-env NAME)")
    if weak := weak_key_reason(api_key, host):
        raise UnprotectedServerError(f"refusing to listen: {weak}")
    name = served_model_name or Path(model).name
    server = ChatServer((host, port), name, api_key=api_key)
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    log = sys.stderr
    log.write(f"arpo serving: listening on http://{host}:{server.server_port}"
              f"{' (API key required on /v1)' if api_key else ''}, loading {model}\n")
    log.flush()
    try:
        started = time.monotonic()
        policy = HFPolicy(model, device=device, compute_dtype=dtype, max_new_tokens=max_new_tokens)
        server.backend = HFChatBackend(policy, max_new_tokens=max_new_tokens)
        took = time.monotonic() - started
        log.write(f"arpo serving: model '{name}' loaded on {policy.device} in {took:.1f}s; ready\n")
        log.flush()
        while thread.is_alive():
            thread.join(1.0)
    finally:
        log.write("arpo serving: shutting down\n")
        log.flush()
        server.shutdown()
        server.server_close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `python -m arpo_lib.serving.server`."""
    p = argparse.ArgumentParser(prog="python -m arpo_lib.serving.server",
                                description="OpenAI-compatible server for a UI-TARS policy")
    p.add_argument("--model", required=True, help="model directory (Hugging Face layout)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name /v1/models reports (default: the directory name)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="compute dtype (auto: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="default max_tokens")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--api-key-env", default=None, metavar="NAME",
                   help="environment variable holding the key required on /v1/* (required off loopback)")
    args = p.parse_args(argv)
    from arpo_lib.serving.launch import api_key_from_env

    try:
        serve(args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
              device=args.device, dtype=args.dtype, max_new_tokens=args.max_new_tokens, threads=args.threads,
              api_key=api_key_from_env(args.api_key_env))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
