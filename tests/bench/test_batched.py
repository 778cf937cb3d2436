"""`python -m treedec.bench bench.batch_sizes=[...]` on the tiny stack: throughput, τ and × vanilla per batch size."""
from __future__ import annotations

import json

import pytest

from tests.bench.configs import bench_cfg
from treedec.bench import batched, harness
from treedec.bench.methods import Prompt


def test_batches_are_full_and_take_the_prompts_in_turn():
    ps = [Prompt(str(i), "", [i] * (i + 1)) for i in range(3)]
    assert batched.batches(ps, 2) == [[[0], [1, 1]], [[2, 2, 2], [0]]]
    assert [len(g) for g in batched.batches(ps, 4)] == [4]
    with pytest.raises(ValueError, match="batch_sizes"):
        batched.batches(ps, 0)


def test_bench_reports_every_method_per_batch_size(stack, tmp_path):
    cfg = bench_cfg(stack, tmp_path, "bench.batch_sizes=[1,2,3]", "bench.methods=[vanilla,dynamic,auto]",
                    "bench.peers=[hf_greedy]", "bench.repeats=1", "bench.plots=true")
    m = harness.run(cfg)
    saved = json.loads((tmp_path / "metrics.json").read_text())["batched"]
    assert saved["sizes"] == [1, 2, 3] and not saved["failures"] and m["batched"]["sizes"] == [1, 2, 3]
    names = {"vanilla", "dynamic", "auto", "hf_greedy"}
    for b in ("1", "2", "3"):
        rows = saved["by_size"][b]
        assert set(rows) == names
        assert rows["vanilla"]["speedup"] == pytest.approx(1.0) and rows["vanilla"]["tau"] == pytest.approx(1.0)
        for name in ("dynamic", "auto"):
            e = rows[name]
            assert e["identical_to_vanilla"] and e["tokens_per_s"] > 0 and e["tau"] >= 1.0
            assert e["new_tokens"] == rows["vanilla"]["new_tokens"]
        assert rows["auto"]["auto_arms"]
    # 2 prompts of different lengths: batch 3 wraps around, so it decodes 3 rows, batch 2 two.
    assert saved["by_size"]["3"]["vanilla"]["new_tokens"] > saved["by_size"]["2"]["vanilla"]["new_tokens"]
    md = (tmp_path / "results.md").read_text()
    assert "Throughput by batch size" in md and "b=3 tok/s" in md
    assert (tmp_path / "batch_throughput.png").stat().st_size > 0


def test_bad_batch_size_fails_with_a_clear_error(stack, tmp_path):
    from treedec.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="batch"):
        harness.run(bench_cfg(stack, tmp_path, "bench.batch_sizes=[0]", "bench.methods=[vanilla]", "bench.peers=[]",
                              "bench.repeats=1"))


def test_static_and_continuous_batches_decode_the_same_tokens(stack, tmp_path):
    """Continuous batching refills slots from the queue; static batching runs full batches in turn: every prompt's
    tokens are the same either way (vanilla is the reference in both)."""
    runs = {}
    for mode in ("continuous", "static"):
        cfg = bench_cfg(stack, tmp_path / mode, "bench.batch_sizes=[2]", "bench.methods=[vanilla,chain]",
                        "bench.peers=[]", "bench.repeats=1", f"bench.batch_mode={mode}")
        runs[mode] = harness.run(cfg)["batched"]
        assert runs[mode]["mode"] == mode and not runs[mode]["failures"]
        assert runs[mode]["by_size"]["2"]["chain"]["identical_to_vanilla"]
    assert (runs["continuous"]["by_size"]["2"]["vanilla"]["new_tokens"]
            == runs["static"]["by_size"]["2"]["vanilla"]["new_tokens"])
    assert "continuous batching" in (tmp_path / "continuous" / "results.md").read_text()


def test_unknown_batch_mode_names_the_choices(stack, tmp_path):
    from treedec.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="continuous"):
        harness.run(bench_cfg(stack, tmp_path, "bench.batch_sizes=[2]", "bench.methods=[vanilla]",
                              "bench.peers=[]", "bench.repeats=1", "bench.batch_mode=paged"))
