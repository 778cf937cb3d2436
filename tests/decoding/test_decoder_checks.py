"""Python API misuse fails when the decoder (or model) is built, with a message naming the fix (issue 39: 12, 19)."""
from __future__ import annotations

import logging

import pytest
import torch

from treedec.decoding.speculative import SANE_DEPTH, SpeculativeDecoder
from treedec.errors import ConfigError
from treedec.sampling import SamplingParams
from treedec.tree.policies import ChainPolicy, DynamicPolicy
from treedec.tree.tree import TreeError


def test_a_dict_of_sampling_fields_is_converted_and_anything_else_names_sampling_params(tiny_pair):
    target, head = tiny_pair
    dec = SpeculativeDecoder(target, head, ChainPolicy(depth=2), sampling={"temperature": 0.8, "top_p": 0.9})
    assert dec.sampling == SamplingParams(temperature=0.8, top_p=0.9)
    assert SpeculativeDecoder(target, head, ChainPolicy(depth=2), sampling=None).sampling == SamplingParams()
    with pytest.raises(TypeError, match=r"unknown key\(s\) temp; SamplingParams takes temperature, top_k, top_p"):
        SpeculativeDecoder(target, head, ChainPolicy(depth=2), sampling={"temp": 0.8})
    with pytest.raises(TypeError, match=r"sampling must be a SamplingParams .* got float 0\.8"):
        SpeculativeDecoder(target, head, ChainPolicy(depth=2), sampling=0.8)


def test_a_tree_deeper_than_the_context_is_refused_and_a_deep_one_warned_about(tiny_pair, caplog):
    target, head = tiny_pair
    ctx = target.config.context_length
    with pytest.raises(ConfigError, match=rf"^tree\.depth={ctx}: .* needs {ctx + 1} positions, more than the "
                                          rf"model's context of {ctx} tokens; lower tree\.depth"):
        SpeculativeDecoder(target, head, ChainPolicy(depth=ctx))
    with caplog.at_level(logging.WARNING, logger="treedec.decoding.speculative"):
        SpeculativeDecoder(target, head, ChainPolicy(depth=SANE_DEPTH))
        assert not caplog.records
        SpeculativeDecoder(target, head, ChainPolicy(depth=SANE_DEPTH + 1))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"tree.depth={SANE_DEPTH + 1}"]
    assert "rarely pays" in caplog.records[0].getMessage()


def test_a_policy_of_non_whole_sizes_is_refused_at_construction(tiny_pair):
    target, head = tiny_pair
    policy = ChainPolicy(depth=3)
    policy.max_depth = 2.5  # a policy of one's own that took depth=2.5 as it is
    with pytest.raises(ConfigError, match=r"ChainPolicy\.max_depth=2\.5 is not a whole number"):
        SpeculativeDecoder(target, head, policy)


def test_load_model_names_the_dtypes_a_model_loads_in():
    from treedec.models import load_model

    with pytest.raises(ValueError, match=r"load_model\(dtype=torch\.int8\): a model loads in torch\.bfloat16, "
                                         r"torch\.float16, torch\.float32"):
        load_model("tiny-code", dtype=torch.int8)


@pytest.mark.parametrize("make", [lambda: ChainPolicy(2.5), lambda: ChainPolicy("3"), lambda: ChainPolicy(True),
                                  lambda: DynamicPolicy(16, depth="6"), lambda: DynamicPolicy(16, 6, top_k=2.5),
                                  lambda: DynamicPolicy(16.0, 6)], ids=["chain-float", "chain-str", "chain-bool",
                                                                         "dynamic-depth", "dynamic-top_k", "dynamic-T"])
def test_a_policy_refuses_settings_that_are_not_whole_numbers_at_construction(make):
    """Issue 39.19b: one clear line naming the key, not a TypeError deep in the constructor or the first step."""
    with pytest.raises(TreeError, match=r"tree\.\w+=.* must be a whole number"):
        make()

