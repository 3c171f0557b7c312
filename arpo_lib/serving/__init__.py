"""Serving the policy over an OpenAI-compatible API: our transformers server (`server`), starting
and stopping servers, ours or vLLM's (`launch`), and keeping a server on a trainer's weights
(`weight_sync`). The HTTP client lives with the policy that uses it (`arpo_lib.agent.client`)."""
from arpo_lib.agent.client import ServerError, chat_completion, ui_tars_messages
from arpo_lib.serving.launch import ServerHandle, find_vllm_python, start_server, stop_server

__all__ = ["ServerError", "ServerHandle", "chat_completion", "find_vllm_python", "start_server", "stop_server",
           "ui_tars_messages"]
