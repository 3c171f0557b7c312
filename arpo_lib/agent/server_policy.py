"""A policy served over an OpenAI-compatible API: vLLM, our `hf` server, or a remote endpoint.

`ServerPolicy` is a drop-in for `HFPolicy` in the rollout engine (`new_conversation`, `parse`,
`generate`) without loading the model here: only the processor (tokenizer and chat template) is
loaded, to keep the token-exact conversation the trainer trains on.

How a step goes: the engine hands over every live episode at once; each becomes one chat request
(the UI-TARS history with its newest screenshots as PNG data URLs), all sent concurrently from a
thread pool, each with the episode's own seed, a timeout and bounded retries. The answer's token
ids and log-probs (vLLM's `return_token_ids` + `logprobs`; our `hf` server answers the same way)
are appended to the episode's conversation exactly, so server trajectories train token-in /
token-out. Where a server returns the prompt's token ids too, they are compared with ours: a
difference means the server's chat template or tokenizer is not the model's, and is counted in
`prompt_mismatches` (the trainer reports it) because the behaviour log-probs then belong to
another prompt.

Departures from HFPolicy: vision tokens are kept out of responses with a logit bias of -100
(not -inf); a server without token ids (a plain OpenAI endpoint) gives responses re-tokenized
here and no behaviour log-probs (`exact=False`): fine for evaluation, not for training.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

from arpo_lib.agent.client import ServerError, chat_completion, ui_tars_messages
from arpo_lib.agent.prompt import (UITarsConversations, coord_mode_for, image_processor_limits, DEFAULT_PROMPT,
                                   get_prompt, load_processor, response_text, special_token_ids)
from arpo_lib.types import Generation, SamplingParams, Segment

# The UI-TARS action grammar as a regular expression, for constrained decoding (vLLM's
# `structured_outputs.regex`): an optional Thought, then one Action line whose call is one of
# the action space's calls with its arguments in UI-TARS syntax.
_POINT = r"'\(\d{1,4},\d{1,4}\)'"
_TEXT = r"'([^'\\\n]|\\.){0,200}'"
_CALLS = [
    rf"click\(start_box={_POINT}\)", rf"left_double\(start_box={_POINT}\)", rf"right_single\(start_box={_POINT}\)",
    rf"drag\(start_box={_POINT}, end_box={_POINT}\)", r"hotkey\(key='[a-z0-9]{1,10}( [a-z0-9]{1,10}){0,2}'\)",
    rf"type\(content={_TEXT}\)", rf"scroll\(start_box={_POINT}, direction='(up|down|left|right)'\)",
    r"wait\(\)", rf"finished\(content={_TEXT}\)", r"finished\(\)", r"call_user\(\)",
]
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}
"""Sent with every request: a server (vLLM) fills unset sampling fields from the checkpoint's
generation_config.json otherwise (Qwen2.5-VL-Instruct's: repetition penalty 1.05, top_k 1), and
rollouts must sample exactly as rollout.* says."""
ACTION_REGEX = r"(Thought: [^\n]{1,400}\n)?Action: (" + "|".join(_CALLS) + ")"


class ServerPolicy(UITarsConversations):
    """UI-TARS generation through an OpenAI-compatible endpoint, for the rollout engine."""

    concurrent_requests = True
    """Safe to call from several threads: an asynchronous rollout sends each episode's request as
    soon as its observation is in, and the server batches them."""

    def __init__(
        self,
        base_url: str,
        model_path: str | Path,
        *,
        served_model: str | None = None,
        api_key_env: str | None = None,
        coord_mode: str = "auto",
        history_images: int = 15,
        max_new_tokens: int = 256,
        timeout_s: float = 120.0,
        retries: int = 3,
        backoff_s: float = 1.0,
        constrained: bool = False,
        max_concurrency: int = 32,
        prompt: str = DEFAULT_PROMPT,
    ):
        """`model_path`: the served model's directory (or a copy of its processor files), for the
        tokenizer and chat template. `served_model`: the name to request (default: the first
        model the server lists). `api_key_env`: the name of an environment variable holding the
        key (the key itself is never stored in a config, a log or a run directory).
        `constrained`: ask the server to decode only strings matching `ACTION_REGEX`."""
        self.base_url = base_url.rstrip("/")
        self.path = str(model_path)
        self.processor = load_processor(self.path)
        self.tokenizer = self.processor.tokenizer
        self.coord_mode = coord_mode_for(self.path) if coord_mode == "auto" else coord_mode
        self.history_images = history_images
        self.prompt = get_prompt(prompt)
        self.max_new_tokens = max_new_tokens
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.constrained = constrained
        self._api_key_env = api_key_env
        if api_key_env and not os.environ.get(api_key_env):
            raise ServerError(f"the API key variable {api_key_env} is not set in the environment")
        self.served_model = served_model or self._first_model()
        self.resize = image_processor_limits(self.processor)
        self.eos_ids, self.suppress_ids = special_token_ids(self.tokenizer)
        self.first_prompt_mismatch: str | None = None
        """Where the first prompt the server tokenized otherwise than ours differs (`prompt_difference`)."""
        self.max_concurrency = max_concurrency
        """Requests this client sends at once (its pool's threads)."""
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="arpo-client")
        self._lock = threading.Lock()
        self.requests = 0
        self.prompt_mismatches = 0
        """Requests whose server-side prompt token ids differed from ours (see the module doc)."""
        self.inexact = 0
        """Responses without server token ids / log-probs (re-tokenized here)."""

    # -- generation (conversations and parsing come from UITarsConversations) -----------------
    def generate(
        self,
        segments: Sequence[Segment],
        *,
        sampling: SamplingParams = SamplingParams(),
        contexts: Sequence[Any] | None = None,
        seeds: Sequence[int] | None = None,
        cache_keys: Sequence[Any] | None = None,
    ) -> list[Generation]:
        """One response per episode, all requested concurrently. `contexts` (the engine's
        PolicyContext, with `screenshots` and `responses` so far) are required: the server gets
        messages, not our tokens. `cache_keys` are ignored: prefix reuse is the server's business
        (vLLM's automatic prefix caching)."""
        if not segments:
            return []
        if contexts is None or len(contexts) != len(segments):
            raise ValueError("ServerPolicy.generate needs one context (instruction, screenshots, responses) per segment")
        jobs = [self._pool.submit(self._one, seg, ctx, sampling, None if seeds is None else int(seeds[i]) % 2**31)
                for i, (seg, ctx) in enumerate(zip(segments, contexts))]
        return [job.result() for job in jobs]

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def base_urls(self) -> list[str]:
        """The servers behind this policy (one; a `FleetPolicy` has several)."""
        return [self.base_url]

    # -- internals ---------------------------------------------------------------------------
    @property
    def _api_key(self) -> str | None:
        return os.environ.get(self._api_key_env) if self._api_key_env else None

    def _first_model(self) -> str:
        import urllib.request

        request = urllib.request.Request(self.base_url + "/models")
        if self._api_key:
            request.add_header("Authorization", f"Bearer {self._api_key}")
        try:
            import json

            with urllib.request.urlopen(request, timeout=self.timeout_s) as resp:
                models = json.loads(resp.read())["data"]
            return models[0]["id"]
        except Exception as exc:
            raise ServerError(f"could not list the models at {self.base_url}/models: {exc}") from exc

    def _one(self, segment: Segment, ctx: Any, sampling: SamplingParams, seed: int | None) -> Generation:
        messages = ui_tars_messages(ctx.instruction, ctx.screenshots, ctx.responses, self.history_images, self.prompt)
        extra: dict[str, Any] = {"logit_bias": {str(i): -100 for i in self.suppress_ids}, **NEUTRAL_SAMPLING,
                                 # the box markers are special tokens: keep them in the text
                                 "skip_special_tokens": False, "spaces_between_special_tokens": False}
        extra["frequency_penalty"] = sampling.frequency_penalty
        if self.constrained:
            extra["structured_outputs"] = {"regex": ACTION_REGEX}
        reply = chat_completion(self.base_url, messages, model=self.served_model, temperature=sampling.temperature,
                                top_p=sampling.top_p, max_tokens=sampling.max_new_tokens or self.max_new_tokens,
                                seed=seed, logprobs=True, return_token_ids=True, extra_body=extra,
                                api_key=self._api_key, timeout_s=self.timeout_s, retries=self.retries,
                                backoff_s=self.backoff_s)
        choice = reply["choices"][0]
        text = choice["message"]["content"] or ""
        ids = choice.get("token_ids")
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [float(c["logprob"]) for c in content]
        prompt_ids = reply.get("prompt_token_ids")
        with self._lock:
            self.requests += 1
            if prompt_ids is not None and list(prompt_ids) != list(segment.input_ids):
                self.prompt_mismatches += 1
                if self.first_prompt_mismatch is None:
                    self.first_prompt_mismatch = prompt_difference(self.tokenizer, list(segment.input_ids),
                                                                   list(prompt_ids))
        if ids is None or len(logprobs) != len(ids):
            # A server without token ids: our tokens of its text; no behaviour log-probs.
            with self._lock:
                self.inexact += 1
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if choice.get("finish_reason") == "stop":
                ids = list(ids) + [self.eos_ids[0]]
            logprobs = [0.0] * len(ids)
        else:  # the history text is the sampled tokens' own text, whatever the server's detokenizer did
            text = response_text(self.tokenizer, list(ids), self.eos_ids)
        return Generation(text=text, token_ids=list(ids), logprobs=logprobs)


def prompt_difference(tokenizer: Any, ours: list[int], theirs: list[int]) -> str:
    """Where two tokenizations of one prompt part: the first differing position, both tokens and the
    text before it."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))

    def token(ids: list[int]) -> str:
        return repr(tokenizer.convert_ids_to_tokens(ids[at])) if at < len(ids) else "(the prompt ends)"

    before = tokenizer.decode(ours[max(0, at - 12):at])
    return (f"token {at} of {len(ours)} (the server's prompt has {len(theirs)}): ours {token(ours)}, the server's "
            f"{token(theirs)}, after {before!r}")


class FleetPolicy:
    """Several servers of the same model (a trainer's `serve.replicas`) as one policy: each
    episode is sent to one server for its whole life (the one with the fewest live episodes when
    it starts, ties in turn; its conversation's growing prefix then stays in that server's prefix
    cache), the servers answer
    concurrently. Sampling does not depend on the server: every request carries its episode's
    seed. Conversations and parsing are the first client's (every client has the same processor).

    `first`: the server the first tie-break picks. Every training process holds its own fleet of
    the same servers, so each starts at `rank % replicas` (`connect_all`): started at 0 everywhere,
    8 ranks with 2 episodes each would leave the third of 3 servers idle."""

    def __init__(self, clients: Sequence[ServerPolicy], first: int = 0):
        if not clients:
            raise ValueError("a fleet needs at least one server")
        self.clients = list(clients)
        self._server_of: dict[Any, int] = {}
        self._lock = threading.Lock()  # asynchronous rollouts call from several threads
        self._turn = first % len(self.clients)  # where the next tie-break starts: episodes in turn rotate
        # asynchronous rollouts call from one thread per episode: the fleet passes on as many requests
        # at once as its servers' clients take (one thread per server held 2 replicas to 2 in flight)
        workers = sum(getattr(c, "max_concurrency", 1) for c in self.clients)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="arpo-fleet")

    def __getattr__(self, name: str) -> Any:  # processor, parse, new_conversation, history_images, ...
        if name in ("clients", "_server_of", "_turn", "_pool", "_lock"):
            raise AttributeError(name)
        return getattr(self.clients[0], name)

    @property
    def base_urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    @property
    def base_url(self) -> str:
        return self.clients[0].base_url

    def server_for(self, key: Any) -> int:
        """The server of episode `key`: its own once chosen, else the one with fewest live
        episodes (ties: the next in turn)."""
        with self._lock:
            return self._choose(key)

    def _choose(self, key: Any) -> int:
        if key not in self._server_of:
            n = len(self.clients)
            load = [0] * n
            for s in self._server_of.values():
                load[s] += 1
            chosen = min(range(n), key=lambda s: (load[s], (s - self._turn) % n))
            self._server_of[key], self._turn = chosen, (chosen + 1) % n
        return self._server_of[key]

    def release(self, key: Any) -> None:
        with self._lock:
            self._server_of.pop(key, None)
        self.clients[0].release(key)

    def generate(self, segments: Sequence[Segment], *, sampling: SamplingParams = SamplingParams(),
                 contexts: Sequence[Any] | None = None, seeds: Sequence[int] | None = None,
                 cache_keys: Sequence[Any] | None = None) -> list[Generation]:
        """`ServerPolicy.generate` over the fleet: each segment to its episode's server."""
        if not segments:
            return []
        keys = list(cache_keys) if cache_keys is not None else [("call", i) for i in range(len(segments))]
        by_server: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            by_server.setdefault(self.server_for(key), []).append(i)
        if cache_keys is None:  # one-off requests: nothing to keep
            with self._lock:
                for key in keys:
                    self._server_of.pop(key, None)

        def pick(values: Sequence[Any] | None, idx: list[int]) -> list[Any] | None:
            return None if values is None else [values[i] for i in idx]

        jobs = {s: self._pool.submit(self.clients[s].generate, [segments[i] for i in idx],
                                     sampling=sampling, contexts=pick(contexts, idx), seeds=pick(seeds, idx))
                for s, idx in by_server.items()}
        out: list[Generation | None] = [None] * len(segments)
        for s, idx in by_server.items():
            for i, gen in zip(idx, jobs[s].result()):
                out[i] = gen
        return out  # type: ignore[return-value]

    @property
    def requests(self) -> int:
        return sum(c.requests for c in self.clients)

    @property
    def prompt_mismatches(self) -> int:
        return sum(c.prompt_mismatches for c in self.clients)

    @property
    def first_prompt_mismatch(self) -> str | None:
        return next((c.first_prompt_mismatch for c in self.clients if getattr(c, "first_prompt_mismatch", None)), None)

    @property
    def inexact(self) -> int:
        return sum(c.inexact for c in self.clients)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
