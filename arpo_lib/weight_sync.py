"""Pushing a trainer's updated weights to the server that generates its rollouts.

Two ways, chosen with `rollout.weight_sync` (see docs/serving.md for the measured trade-offs):

- `reload`: the weights are saved as a model directory; the running vLLM server (started with
  `serve.weight_sync=true`: dev endpoints and our worker extension `arpo_vllm_ext`) pauses,
  reloads them in place, drops every cache that holds results of the old weights (prefix KV,
  encoder outputs, multimodal inputs) and resumes. No restart, no re-compilation; the server keeps
  its KV memory. The server must be able to read the directory (same machine or shared storage).
- `restart`: stop the server and start a new one on the saved directory. Works with any backend
  (our `hf` server, a vLLM without dev mode), costs a full start-up per update (vLLM: ~30-60 s on
  CPU, minutes for a 7B model on GPU with compilation).

LoRA adapters loaded by name (`/v1/load_lora_adapter`) would move only the adapter, but the
trainer trains full weights; see docs/serving.md for how LoRA serving works on these servers.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from arpo_lib.serving import post_json


def _root(url: str) -> str:
    """The server root from a base URL (`http://h:p/v1` -> `http://h:p`)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def reload_weights(server_url: str, model_dir: str | Path, *, timeout_s: float = 600.0) -> dict[str, Any]:
    """Make a running vLLM server (weight_sync enabled) serve the weights in `model_dir`.

    Requests in flight finish first (`/pause?mode=wait`); afterwards no answer can come from a
    cache filled by the old weights. Returns timings and what the extension reported."""
    root = _root(server_url)
    t0 = time.monotonic()
    post_json(root + "/pause?mode=wait", None, timeout_s=timeout_s, retries=0)
    try:
        result = post_json(root + "/collective_rpc", {"method": "arpo_reload_weights",
                                                      "kwargs": {"weights_path": str(Path(model_dir).resolve())}},
                           timeout_s=timeout_s, retries=0)
        for cache in ("/reset_encoder_cache", "/reset_mm_cache", "/reset_prefix_cache"):
            post_json(root + cache, None, timeout_s=60, retries=1)
    finally:
        post_json(root + "/resume", None, timeout_s=60, retries=2)
    return {"seconds": time.monotonic() - t0, "result": result}


def server_checksum(server_url: str) -> float:
    """The sum of the served model's parameters (our extension's `arpo_weights_checksum`)."""
    reply = post_json(_root(server_url) + "/collective_rpc", {"method": "arpo_weights_checksum"}, timeout_s=120)
    results = reply.get("results") if isinstance(reply, dict) else reply
    return float(results[0])


def save_for_server(policy: Any, directory: Path) -> Path:
    """Save the policy's weights (and processor) as a model directory the server can load;
    replaced atomically, so a server never reads a half-written directory."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    policy.save(tmp)
    old = directory.with_name(directory.name + ".old")
    if directory.exists():
        if old.exists():
            shutil.rmtree(old)
        directory.rename(old)
    tmp.rename(directory)
    if old.exists():
        shutil.rmtree(old)
    return directory
