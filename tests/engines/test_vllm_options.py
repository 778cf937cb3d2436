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


def test_regenerate_engine_settings_are_checked(monkeypatch, tmp_path):
    import importlib.util

    from treedec.config import ConfigError, validate

    records = tmp_path / "r.jsonl"
    records.write_text('{"text": "def f(x):"}\n')
    base = [f"input={records}", f"paths.run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError, match="engine='fast'; choose one of lightning, vllm"):
        validate(compose_config("regenerate", base + ["engine=fast"]), "regenerate")
    with pytest.raises(ConfigError, match="vllm_args is for engine=vllm"):
        validate(compose_config("regenerate", base + ["+vllm_args.tensor_parallel_size=2"]), "regenerate")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match="engine=vllm needs vLLM, which is not installed: make vllm"):
        validate(compose_config("regenerate", base + ["engine=vllm"]), "regenerate")
