"""bench.draft_heads (every method with every head, METHOD@HEAD), the one-pass methods (parallel_chain, best_first)
and the budget sweeps (bench.dynamic_sweep / bench.best_first_sweep), on a tiny random target with an EAGLE head and
a one-pass (parallel) head made from an EAGLE-3 one."""
from __future__ import annotations

import json
import re

import pytest

from tests.bench.configs import bench_cfg
from treedec.bench import harness
from treedec.heads import DraftConfig, build_head
from treedec.heads.parallel import ParallelHead


@pytest.fixture(scope="module")
def heads(stack):
    """An EAGLE head (``eagle``, the stack's own) and a one-pass head of block size 8 (``parallel``)."""
    from treedec.models.checkpoint import load_model

    target = load_model(stack / "target")
    ParallelHead.from_eagle3(build_head(DraftConfig.for_target(target.config, kind="eagle3")), 8).save(
        stack / "parallel")
    return [str(stack / "draft"), str(stack / "parallel")]


TINY = ("bench.peers=[]", "bench.repeats=1", "bench.warmup=0", "bench.max_new_tokens=8",
        "bench.trees.best_first.total_tokens=6", "bench.trees.best_first.depth=3")


def test_methods_cross_heads_and_rejected_pairs_are_skipped(stack, heads, tmp_path):
    m = harness.run(bench_cfg(stack, tmp_path, *TINY, f"bench.draft_heads=[{heads[0]},{heads[1]}]",
                              "bench.methods=[vanilla,chain,dynamic,best_first,parallel_chain]"))
    assert list(m["methods"]) == ["vanilla", "chain@draft", "chain@parallel", "dynamic@draft", "best_first@parallel",
                                  "parallel_chain@draft", "parallel_chain@parallel"]
    # a tree the head cannot feed is skipped with check_head's reason, never an error
    assert set(m["skipped"]) == {"dynamic@parallel", "best_first@draft"}
    assert "one-pass" in m["skipped"]["dynamic@parallel"] and "marginals" in m["skipped"]["best_first@draft"]
    assert m["heads"]["parallel"] == {"path": heads[1], "kind": "parallel", "one_pass": True, "block_size": 8,
                                      "dtype": "float32"}
    assert m["heads"]["draft"]["kind"] == "eagle" and m["failures"] == []
    for name, e in m["methods"].items():
        assert e["identical_to_vanilla"] is True, (name, e.get("mismatches"))
        if name == "vanilla":
            continue
        assert e["head"] == name.split("@")[1] and e["speedup"] > 0 and e["tau"] >= 1.0
        assert 1 in e["accept_by_depth"] and all(0 <= v <= 1 for v in e["accept_by_depth"].values()), name
        assert set(e["step_split"]) == {"draft", "verify", "accept", "commit", "other"}, name
        assert e["step_split"]["verify"] > 0 and sum(e["step_split"].values()) == pytest.approx(1.0, abs=0.02), name
    assert m["methods"]["parallel_chain@parallel"]["tree_depth"] == 8
    md = (tmp_path / "results.md").read_text()
    assert "Acceptance by position" in md and "| best_first@parallel |" in md and "draft heads `draft`" in md
    assert re.search(r"^Skipped .*`dynamic@parallel`.*: DynamicPolicy drafts node by node", md, re.M)  # one line per reason
    lines = [json.loads(ln) for ln in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert {ln["method"] for ln in lines} == set(m["methods"])


def test_budget_sweeps_per_head_kind_and_their_plot(stack, heads, tmp_path):
    m = harness.run(bench_cfg(stack, tmp_path, *TINY, f"bench.draft_heads=[{heads[0]},{heads[1]}]",
                              "bench.methods=[vanilla]", "bench.dynamic_sweep=[8]",
                              "bench.best_first_sweep=[4,6]", "bench.plots=true", "bench.batch_sizes=[2]"))
    assert m["dynamic_sweep"] == {"methods": ["dynamic_T8@draft"], "auto": []}
    assert m["best_first_sweep"] == {"methods": ["best_first_T4@parallel", "best_first_T6@parallel"], "auto": []}
    assert set(m["skipped"]) == {"dynamic_T8@parallel", "best_first_T4@draft", "best_first_T6@draft"}
    for T in (4, 6):
        e = m["methods"][f"best_first_T{T}@parallel"]
        assert e["tree_size"] == T and e["tree_depth"] == 3 and e["identical_to_vanilla"] is True
    assert (tmp_path / "budget_sweep.png").is_file()
    # batches run with the first head, and only the trees it can feed
    assert set(m["batched"]["by_size"]["2"]) == {"vanilla", "dynamic_T8"} and m["batched"]["failures"] == []


def test_draft_heads_option_is_checked_before_loading(stack, tmp_path):
    from treedec.config import ConfigError

    for override, needle in [("bench.draft_heads=[]", r"at least one head"),
                             ("bench.draft_heads=[tiny_cod]", r"neither a draft config.*Did you mean tiny_code\?"),
                             (f"bench.draft_heads=[{stack / 'draft'},{stack / 'draft'}]", r"both go by 'draft'")]:
        with pytest.raises(ConfigError, match=needle):
            harness.run(bench_cfg(stack, tmp_path, "model.path=/nonexistent/model", override))


def test_a_bench_whose_every_pair_is_skipped_is_one_error_before_timing(stack, heads, tmp_path, monkeypatch):
    """The user asked for a comparison and no method@head pair can run: one error naming each pair, why it was
    skipped and what each head can draft, before any timing (not vanilla rows alone and exit status 0)."""
    from treedec.errors import ConfigError

    monkeypatch.setattr(harness, "time_methods", lambda *a, **k: pytest.fail("timed a bench that compares nothing"))
    with pytest.raises(ConfigError) as err:
        harness.run(bench_cfg(stack, tmp_path, *TINY, f"bench.draft_heads=[{heads[1]}]",
                              "bench.methods=[vanilla,dynamic,static]"))
    msg = str(err.value)
    assert msg.startswith("bench.methods=['vanilla', 'dynamic', 'static']: every tree method was skipped, so the bench "
                          "would compare nothing: dynamic@parallel (DynamicPolicy drafts node by node, one head pass "
                          "per depth; this draft head is a one-pass (parallel) head that drafts per-position "
                          "marginals); static@parallel (StaticPolicy drafts node by node"), msg
    assert re.search(r"choose methods these heads can draft \(bench\.methods=\[vanilla,\.\.\.\] from parallel: "
                     r"[^;]*\bparallel_chain\b[^;]*\bbest_first\b", msg) and "\n" not in msg and "tree=" not in msg, msg
    assert not (tmp_path / "metrics.json").exists()
