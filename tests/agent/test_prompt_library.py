"""Every named prompt equals its source character for character (stored copies in
test_data/prompts/, taken from ARPO, the ARPO authors' OSWorld fork and the UI-TARS repository;
their sources and sha256 in test_data/prompts/SOURCES.md)."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from arpo_lib.agent.prompt import TokenConversation, build_messages, get_prompt
from arpo_lib.agent.prompt_library import PROMPTS

STORED = Path(__file__).resolve().parents[2] / "test_data" / "prompts"


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_each_prompt_equals_its_stored_source(name):
    assert PROMPTS[name].user == (STORED / f"{name}.txt").read_text(encoding="utf-8")
    assert PROMPTS[name].system == (STORED / f"{name}.system.txt").read_text(encoding="utf-8")
    recorded = dict(line.split("  ", 1)[::-1] for line in (STORED / "SOURCES.md").read_text().splitlines()
                    if line[:64].strip() and len(line.split("  ", 1)[0]) == 64)
    assert hashlib.sha256((STORED / f"{name}.txt").read_bytes()).hexdigest() == recorded[f"{name}.txt"]


def test_the_differences_that_matter():
    arpo, fork, official, v10 = (PROMPTS[n] for n in ("arpo", "osworld_uitars15", "uitars_official", "uitars10"))
    assert arpo.system == "Your are a helpful assistant."  # ARPO's own typo, kept
    assert fork.user == official.user and fork.system == official.system == "You are a helpful assistant."
    assert "- Use English in `Thought` and `Action` part." in arpo.user and "\n\n\n## Note" not in arpo.user
    assert "\n\n\n## Note" in official.user
    assert "type(content='') #If you want to submit your input" in v10.user
    assert "type(content='xxx') # Use escape characters" in official.user


def test_the_chosen_prompt_reaches_the_conversation(policy):
    messages = build_messages("open the file", 1, [], 15, "arpo")
    assert messages[0]["content"][0]["text"] == "Your are a helpful assistant."
    assert messages[1]["content"][0]["text"] == PROMPTS["arpo"].render("open the file")
    conv = TokenConversation(policy.processor, "open the file", prompt="arpo")
    from PIL import Image

    conv.add_observation(Image.new("RGB", (56, 56)))
    text = policy.tokenizer.decode(conv.current.input_ids)
    assert "Your are a helpful assistant." in text and "`Thought` and `Action` part" in text
    with pytest.raises(ValueError, match="unknown prompt 'nope'"):
        get_prompt("nope")
