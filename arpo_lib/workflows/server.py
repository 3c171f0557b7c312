"""The inference-server notebook's steps (gpu_inference_server.ipynb): how to reach the running
server, one real UI-TARS request to it, and the last step (stop it, or leave it running)."""
from __future__ import annotations

import time
from typing import Any

from arpo_lib.run.config import RunConfig


def server_instructions(server: Any) -> str:
    """How to reach a running server, with copy-paste examples (the key by its variable's name,
    never the key), from this machine and from another one."""
    from arpo_lib.run.net import is_loopback

    key_env = server.spec.api_key_env
    auth = f' -H "Authorization: Bearer ${key_env}"' if key_env else ""
    client_key = f", rollout.api_key_env={key_env}" if key_env else ""
    port = server.spec.port
    lines = [f"server pid {server.pid} is healthy at {server.url}"
             + (f" (API key required on /v1: the value of ${key_env})" if key_env else ""),
             f"  OpenAI base URL: {server.base_url}   model name: {server.model}",
             f"  curl {server.url}/health",
             f"  curl{auth} {server.base_url}/models",
             f"  python: serving.chat_completion('{server.base_url}', serving.ui_tars_messages(instruction, [screenshot], []), "
             f"model='{server.model}'{', api_key=os.environ[' + repr(key_env) + ']' if key_env else ''})",
             f"  evaluate with it: ./workbench notebook evaluation config=configs/smoke.yaml "
             f"overrides='[rollout.backend=server, rollout.server_url={server.base_url}{client_key}]'"]
    if is_loopback(server.spec.host):
        lines.append(f"  from another machine: ssh -N -L {port}:127.0.0.1:{port} <user>@<this machine>, then "
                     f"rollout.server_url=http://127.0.0.1:{port}/v1 there (or serve.host=0.0.0.0 with serve.api_key_env)")
    else:
        lines.append(f"  from another machine: rollout.server_url=http://<this machine's address>:{port}/v1"
                     f"{client_key} (export {key_env} there with the same key)")
    lines.append(f"  stop later: serving.stop_server({server.pid})")
    return "\n".join(lines)


def finish_server(server: Any, cfg: RunConfig) -> str:
    """The notebook's last step: stop the server, or leave it running with `serve.keep_running`."""
    if cfg.serve.keep_running:
        return (f"left running (serve.keep_running): pid {server.pid} at {server.base_url}; "
                f"stop it with serving.stop_server({server.pid})")
    server.stop()
    return f"stopped (pid {server.pid}); healthy now: {server.health()}"


def server_smoke_request(server: Any, cfg: RunConfig, task: str | None = None) -> dict[str, Any]:
    """Send the server one UI-TARS turn on a real MiniWoB++ screenshot (greedy); parse the reply."""
    from arpo_lib.actions import ActionParseError, parse_response
    from arpo_lib.agent.client import chat_completion, ui_tars_messages
    from arpo_lib.agent.prompt import coord_mode_for
    from arpo_lib.envs import make_env, split_instance

    task, instance = split_instance(task or cfg.env.tasks[0])
    opts = dict(cfg.env.options)
    with make_env(task, **opts) as env:
        obs, _ = env.reset(seed=cfg.eval.seed if instance is None else instance)
    messages = ui_tars_messages(obs.instruction, [obs.screenshot], [], history_images=cfg.model.history_images,
                                prompt=cfg.agent.prompt)
    from arpo_lib.agent.client import ServerRequestError
    from arpo_lib.serving.launch import api_key_from_env

    key = api_key_from_env(server.spec.api_key_env)
    refused_without_key = None
    if key:  # the key must be what lets a request in
        try:
            chat_completion(server.base_url, messages, model=server.model, temperature=0, max_tokens=1)
            refused_without_key = False
        except ServerRequestError as exc:
            refused_without_key = exc.status == 401
    t0 = time.monotonic()
    reply = chat_completion(server.base_url, messages, model=server.model, temperature=0,
                            max_tokens=cfg.model.max_new_tokens, logprobs=True, api_key=key)
    text = reply["choices"][0]["message"]["content"]
    coord_mode = cfg.model.coord_mode if cfg.model.coord_mode != "auto" else coord_mode_for(cfg.model.path)
    try:
        actions = parse_response(text, obs.screenshot.size, coord_mode=coord_mode).actions
        parsed = True
    except ActionParseError as exc:
        actions, parsed = [], f"no ({exc})"
    return {"task": task, "instruction": obs.instruction, "response": text, "parsed": parsed is True,
            "actions": [a.kind for a in actions], "seconds": round(time.monotonic() - t0, 2),
            "usage": reply.get("usage"), "refused_without_key": refused_without_key}

