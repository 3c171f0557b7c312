"""A server that tokenizes the prompt otherwise than the trainer (another chat template or
tokenizer) is named at the first mismatch, and the run stops after its first batch through the
servers, showing the first differing token: its log-probs belong to another prompt."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from arpo_lib.agent import server_policy as sp
from arpo_lib.training.rollout_source import PromptMismatchError, RolloutSource
from benchmarks.common import screenshot


def _client(tiny_qwen2vl, monkeypatch, shift: int):
    """A ServerPolicy whose server answers with the prompt's ids, the one at position 5 changed
    when `shift` (a server with another template)."""
    monkeypatch.setattr(sp.ServerPolicy, "_first_model", lambda self: "m")
    client = sp.ServerPolicy("http://127.0.0.1:1/v1", tiny_qwen2vl, max_new_tokens=4)

    def reply(base_url, messages, **kw):
        prompt = list(reply.prompt)
        if shift:
            prompt[5] += shift
        return {"choices": [{"message": {"content": "ok"}, "token_ids": [11, 12],
                             "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}]}, "finish_reason": "length"}],
                "prompt_token_ids": prompt}

    monkeypatch.setattr(sp, "chat_completion", reply)
    return client, reply


@pytest.mark.parametrize("shift", [0, 1])
def test_the_first_differing_prompt_token_is_named(tiny_qwen2vl, monkeypatch, shift):
    client, reply = _client(tiny_qwen2vl, monkeypatch, shift)
    conv = client.new_conversation("Click the button")
    conv.add_observation(screenshot(1))
    reply.prompt = conv.current.input_ids
    client.generate([conv.current], contexts=[conv], seeds=[0])
    if not shift:
        assert client.prompt_mismatches == 0 and client.first_prompt_mismatch is None
        return
    assert client.prompt_mismatches == 1
    assert client.first_prompt_mismatch.startswith(f"token 5 of {len(conv.current.input_ids)}")
    assert "ours " in client.first_prompt_mismatch and "the server's " in client.first_prompt_mismatch
    fleet = sp.FleetPolicy([client])
    assert fleet.first_prompt_mismatch == client.first_prompt_mismatch


def test_a_run_stops_after_its_first_batch_when_the_servers_prompts_differ():
    served = SimpleNamespace(client=SimpleNamespace(first_prompt_mismatch="token 5 of 900: ours 'a', the server's 'b'"))
    source = RolloutSource.__new__(RolloutSource)
    source.served, source._prompts_checked = served, False
    with pytest.raises(PromptMismatchError, match="token 5 of 900"):
        source._check_prompts()
    served.client.first_prompt_mismatch = None  # checked once, in the first batch
    source._prompts_checked = False
    source._check_prompts()
    assert source._prompts_checked
