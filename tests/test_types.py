"""The contracts of arpo_lib/types.py: sampling options are one dataclass that every policy takes
the same way, and the data types keep their old import paths."""
from __future__ import annotations

import inspect

import pytest

from arpo_lib.types import Policy, SamplingParams, Segment


def test_sampling_params_refuse_impossible_values():
    assert SamplingParams() == SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=None, frequency_penalty=0.0)
    SamplingParams(temperature=0.0, top_p=0.5, max_new_tokens=1)  # greedy, nucleus, one token: fine
    for bad, name in (({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                      ({"max_new_tokens": 0}, "max_new_tokens")):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad)


def test_every_policy_takes_sampling_options_as_one_object():
    """A new sampling option is a field of SamplingParams, never a new argument of each generate."""
    from arpo_lib.agent.hf_policy import HFPolicy
    from arpo_lib.agent.scripted import ScriptedPolicy
    from arpo_lib.agent.server_policy import FleetPolicy, ServerPolicy

    expected = ["segments", "sampling", "contexts", "seeds", "cache_keys"]
    for impl in (Policy, HFPolicy, ServerPolicy, FleetPolicy, ScriptedPolicy):
        params = inspect.signature(impl.generate).parameters
        assert [p for p in params if p != "self"] == expected, impl.__name__
        assert params["sampling"].kind is inspect.Parameter.KEYWORD_ONLY and params["sampling"].default == SamplingParams()


def test_segment_keeps_its_old_import_path():
    from arpo_lib.agent.prompt import Segment as OldPath

    assert OldPath is Segment
