"""The vLLM pieces that need no vLLM: what each export is called in vLLM, and the bench's vLLM options."""
from __future__ import annotations

import pytest

from tests.helpers import compose_config
from treedec.engines.vllm import EngineRun


def test_each_export_format_is_the_vllm_method_that_serves_it():
    assert EngineRun("v").spec_config() is None
    assert EngineRun("e", "/h", "eagle", 4).spec_config() == {"method": "eagle", "model": "/h",
                                                             "num_speculative_tokens": 4}
    assert EngineRun("p", "/h", "peagle", 5).spec_config() == {"method": "eagle3", "parallel_drafting": True,
                                                              "model": "/h", "num_speculative_tokens": 5}
    with pytest.raises(ValueError, match="vLLM serves eagle, eagle3, peagle exports drafting k >= 1"):
        EngineRun("d", "/h", "dflash", 5).spec_config()


def test_vllm_peers_without_vllm_are_skipped_with_the_install_line(monkeypatch, tmp_path):
    from treedec.bench import vllm_peers

    monkeypatch.setattr(vllm_peers, "vllm_available", lambda: False)
    cfg = compose_config("bench", ["bench.peers=[hf_greedy,vllm,vllm_eagle3]", f"paths.run_dir={tmp_path}"])
    methods, skipped = vllm_peers.build_vllm_peers(cfg, None, {}, [], [], tmp_path)
    assert methods == [] and set(skipped) == {"vllm", "vllm_eagle3"}
    assert all("make vllm" in why for why in skipped.values())


@pytest.mark.parametrize("value", ["0", "-2"])  # (a non-integer: the schema refuses it at composition)
def test_vllm_tokens_must_be_a_positive_integer(value, tmp_path):
    from treedec.config import ConfigError, validate

    cfg = compose_config("bench", [f"bench.vllm_tokens={value}", f"paths.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="bench.vllm_tokens=.*an integer >= 1"):
        validate(cfg, "bench")
