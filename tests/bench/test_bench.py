"""`python -m treedec.bench` on a tiny random model: a well-formed metrics.json, and the mismatch detector fires."""
from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from treedec.bench import harness
from treedec.models.checkpoint import save_pretrained
from treedec.models.config import LlamaConfig
from treedec.models.draft import DraftConfig, DraftHead
from treedec.models.llama import Transformer
from treedec.tree.shapes import SHAPE_DIR

from ..training.test_pretrain import TINY_ARCH, corpus, tokenizer  # noqa: F401  (fixtures)

CONF = str(SHAPE_DIR.parents[1])

try:
    import transformers  # noqa: F401

    HAVE_HF = True
except ImportError:  # pragma: no cover - transformers is a dev dependency
    HAVE_HF = False


@pytest.fixture(scope="module")
def stack(tokenizer, tmp_path_factory):  # noqa: F811
    torch.manual_seed(0)
    target = Transformer(LlamaConfig(**{**TINY_ARCH, "max_position_embeddings": 256}), "sdpa")
    root = tmp_path_factory.mktemp("bench_stack")
    save_pretrained(target, root / "target", tokenizer=str(tokenizer[0]))
    DraftHead(DraftConfig.for_target(target.config)).save(root / "draft")
    (root / "prompts.jsonl").write_text(json.dumps({"id": "add", "prompt": "def add(a, b):\n"}) + "\n\n"
                                        + json.dumps({"prompt": "class Thing:\n    def get(self):\n"}) + "\n")
    (root / "learned.yaml").write_text("choices: [[0], [1], [0, 0], [0, 0, 0]]\n")
    return root


def overrides(stack, run_dir, *extra):
    return [f"model.path={stack / 'target'}", "model.dtype=float32", "model.device=cpu", "kernel=sdpa",
            f"draft.path={stack / 'draft'}", f"bench.prompts={stack / 'prompts.jsonl'}", "bench.max_new_tokens=12",
            "bench.repeats=2", "bench.warmup=1", "bench.num_threads=1", f"bench.learned_path={stack / 'learned.yaml'}",
            "tree/shape@bench.trees.static.shape=balanced_2x3", "bench.trees.dynamic.total_tokens=8",
            "bench.trees.dynamic.depth=3", "bench.trees.dynamic.top_k=3", "bench.trees.chain.depth=3",
            f"bench.assistant_path={stack / 'target'}", "bench.plots=false", f"paths.run_dir={run_dir}", *extra]


def compose_bench(stack, run_dir, *extra):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose(config_name="bench", overrides=overrides(stack, run_dir, *extra))


def test_bench_writes_well_formed_metrics(stack, tmp_path):
    m = harness.run(compose_bench(stack, tmp_path, "bench.sampling=true"))
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["methods"].keys() == m["methods"].keys()
    names = set(saved["methods"])
    expected = {"vanilla", "chain", "static", "dynamic", "learned"}
    expected |= {f"{n}_sample" for n in expected}
    if HAVE_HF:
        expected |= {"hf_greedy", "hf_prompt_lookup", "hf_assisted"}
    assert names == expected
    for name, e in saved["methods"].items():
        for key in ("tokens_per_s", "tau", "speedup", "identical_to_vanilla", "new_tokens", "time_split"):
            assert key in e, (name, key)
        assert e["tokens_per_s"] > 0 and e["tau"] >= 1.0 and e["speedup"] > 0 and e["new_tokens"] > 0
        assert e["time_split"]["total"] > 0
        if name.endswith("_sample"):
            assert e["identical_to_vanilla"] is None
        else:
            assert e["identical_to_vanilla"] is True, (name, e.get("mismatches"))
    assert saved["methods"]["vanilla"]["speedup"] == pytest.approx(1.0)
    assert saved["methods"]["vanilla"]["tau"] == 1.0
    assert saved["methods"]["dynamic"]["time_split"]["verify"] > 0
    assert saved["methods"]["learned"]["tree_size"] == 5
    assert saved["machine"]["threads"] == 1 and saved["machine"]["torch"] == torch.__version__
    assert saved["prompts"]["ids"] == ["add", "p1"] and saved["failures"] == []
    assert saved["config"]["bench"]["max_new_tokens"] == 12
    table = (tmp_path / "results.md").read_text()
    assert "| dynamic |" in table and "speedup ÷ τ" in table
    lines = (tmp_path / "outputs.jsonl").read_text().splitlines()
    assert len(lines) == 2 * len(names)


def test_mismatch_fails_the_cli_after_writing_metrics(stack, tmp_path, monkeypatch):
    """Corrupt the dynamic method's tokens: the CLI logs the mismatch and exits non-zero, metrics.json still written."""
    from treedec.decoding.speculative import SpeculativeDecoder
    from treedec.tree.policies import DynamicPolicy

    real = SpeculativeDecoder.generate

    def corrupt(self, *a, **kw):
        res = real(self, *a, **kw)
        if isinstance(self.policy, DynamicPolicy):
            toks = res.tokens[0]
            toks[min(3, len(toks) - 1)] += 1
        return res

    monkeypatch.setattr(SpeculativeDecoder, "generate", corrupt)
    args = overrides(stack, tmp_path, "bench.methods=[vanilla,chain,dynamic]", "bench.peers=[]", "bench.repeats=1",
                     "bench.plots=true")
    monkeypatch.setattr(sys, "argv", ["treedec.bench", *args, f"hydra.run.dir={tmp_path}"])
    with pytest.raises(SystemExit) as exc:  # as `python -m treedec.bench`, in this process (keeps the monkeypatch)
        runpy.run_module("treedec.bench", run_name="__main__", alter_sys=True)
    assert exc.value.code not in (0, None)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["methods"]["chain"]["identical_to_vanilla"] is True
    dyn = saved["methods"]["dynamic"]
    assert dyn["identical_to_vanilla"] is False
    assert dyn["mismatches"][0]["position"] <= 3 and saved["failures"]
    assert dyn["mismatches"][0]["prompt_index"] in (0, 1) and dyn["mismatches"][0]["logit_gap"] is not None
    assert "NO" in (tmp_path / "results.md").read_text()


def test_first_difference():
    assert harness.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert harness.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert harness.first_difference([1, 2, 3], [1, 2]) == 2


def test_bad_options_fail_before_the_model_loads(stack, tmp_path):
    """Typos and out-of-range values are ConfigErrors raised before loading (the model path does not exist)."""
    from treedec.config_schema import ConfigError

    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    cases = [
        ("+bench.max_new_token=999", r"bench\.max_new_token: Key 'max_new_token' not in 'BenchOptionsSchema'\. "
                                     r"Did you mean bench\.max_new_tokens\? Keys of bench: prompts, "),
        ("+bench.trees.dynamic.totl_tokens=8", r"Did you mean bench\.trees\.dynamic\.total_tokens\?"),
        ("bench.repeats=0", r"bench\.repeats=0: must be >= 1"),
        ("bench.warmup=-1", r"bench\.warmup=-1: must be >= 0"),
        ("bench.num_threads=-1", r"bench\.num_threads=-1: must be >= 1"),
        (f"bench.prompts={dup}", r"dup\.jsonl:3: prompt id 'a' is already used on line 1"),
        ("bench.methods=[vanilla,dynamc]", r"bench\.methods names 'dynamc'.*Did you mean dynamic\?"),
        ("bench.peers=[hf_gredy]", r"bench\.peers names 'hf_gredy'\. Did you mean hf_greedy\?"),
        ("bench.prompt_source=pypi", r"bench\.prompt_source='pypi'; choose one of stdlib, third_party"),
        (f"bench.learned_path={tmp_path / 'none.yaml'}", r"bench\.learned_path=.*: no such file"),
        ("bench.trees.dynamic.total_tokens=1", r"invalid bench\.trees\.dynamic config: total_tokens=1"),
    ]
    for override, needle in cases:
        cfg = compose_bench(stack, tmp_path, "model.path=/nonexistent/model", override)
        with pytest.raises(ConfigError, match=needle):
            harness.run(cfg)
    assert not (tmp_path / "metrics.json").exists()


def test_third_party_prompts_are_recorded(stack, tmp_path):
    """bench.prompt_source=third_party: prompts from installed packages, each one's file and line in metrics.json."""
    cfg = compose_bench(stack, tmp_path, "bench.prompts=null", "bench.prompt_source=third_party", "bench.n_prompts=2",
                        "bench.prompt_tokens=24", "bench.methods=[vanilla,chain]", "bench.peers=[]", "bench.repeats=1",
                        "bench.max_new_tokens=4")
    m = harness.run(cfg)
    pr = json.loads((tmp_path / "metrics.json").read_text())["prompts"]
    assert pr["source"] == "third_party" and pr["n"] == 2 and sorted(pr["sources"]) == sorted(pr["ids"])
    for pid in pr["ids"]:
        src = pr["sources"][pid]
        assert Path(src["file"]).is_file() and "site-packages" in src["file"] and src["line"] >= 1
    assert m["methods"]["chain"]["identical_to_vanilla"] is True
    assert "(third_party)" in (tmp_path / "results.md").read_text()


def test_gpu_check_reports_all_skipped_tests_as_skipped():
    from treedec.bench.gpu import pytest_status

    assert pytest_status("ssss\n4 skipped, 120 deselected in 1.20s\n", 0) == "skipped"
    assert pytest_status("\n120 deselected in 0.50s\n", 5) == "skipped"
    assert pytest_status("..s\n2 passed, 1 skipped in 3.0s\n", 0) is None
    assert pytest_status("F.\n1 failed, 1 passed in 3.0s\n", 1) is None


def test_numerical_ties_are_reported_but_only_real_mismatches_fail():
    from treedec.bench.harness import classify_mismatches

    def entry(gaps):
        return {"lossless_check": True, "failure_message": "differs",
                "mismatches": [{"logit_gap": g, "ulp": 0.0625} for g in gaps]}

    table = {"tied": entry([0.0, 0.0625]), "real": entry([0.0, 0.5]), "unknown": entry([None]),
             "peer": {"mismatches": [{"logit_gap": 3.0, "ulp": 0.0625}]}}
    failures = classify_mismatches(table, tie_ulps=1.0)
    assert failures == ["differs", "differs"]  # "real" and "unknown"; ties and peers do not fail
    assert table["tied"]["tie_flips"] == 2 and table["real"]["tie_flips"] == 1
    assert classify_mismatches({"tied": entry([0.0])}, tie_ulps=0.0) == []  # an exact tie is a tie even at 0
    assert classify_mismatches({"tied": entry([0.01])}, tie_ulps=0.0) == ["differs"]
