"""`python -m treedec.bench` on a tiny random model: a well-formed metrics.json, and the mismatch detector fires."""
from __future__ import annotations

import json
import runpy
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.bench.configs import bench_cfg, bench_overrides
from tests.helpers import TINY_ARCH, compose_config
from treedec.bench import harness, timing
from treedec.bench import methods as bm
from treedec.models.checkpoint import save_pretrained
from treedec.models.config import LlamaConfig
from treedec.models.llama import Transformer


def test_bench_writes_well_formed_metrics(stack, tmp_path):
    m = harness.run(bench_cfg(stack, tmp_path, "bench.sampling=true"))
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["methods"].keys() == m["methods"].keys()
    names = set(saved["methods"])
    treedec = {"vanilla", "chain", "static", "dynamic_raw", "dynamic", "auto", "learned", "lookup"}
    expected = treedec | {"hf_greedy", "hf_prompt_lookup", "hf_assisted"}
    assert names == expected
    # bench.sampling=true: every method sampled at both default temperatures, grouped by temperature.
    assert list(saved["sampled"]) == ["0.8", "0.3"]
    for t, group in saved["sampled"].items():
        assert group["temperature"] == float(t) and group["top_p"] == 0.95 and group["top_k"] == 0
        sampled = {f"{n}_sample" for n in treedec} | {"hf_sample"}
        assert set(group["methods"]) == sampled, t
        assert group["methods"]["vanilla_sample"]["speedup"] == pytest.approx(1.0)
        for name, e in group["methods"].items():
            assert e["identical_to_vanilla"] is None and e["greedy"] is False and e["new_tokens"] > 0, name
            assert e["tokens_per_s"] > 0 and e["tau"] >= 1.0, name
            base = m["sampled"][t]["methods"]["vanilla_sample"]["tokens_per_s"]
            assert e["speedup"] == pytest.approx(e["tokens_per_s"] / base), name  # against the same temperature
            if name == "hf_sample":
                assert e["accept_share"] is None  # transformers' loop: not our clocks
            elif name == "vanilla_sample":
                assert 0.0 <= e["accept_share"] <= 1.0  # its pick of the next token
            else:
                assert 0.0 < e["accept_share"] <= 1.0, (name, e["time_split"])
                assert e["accept_share"] == pytest.approx(e["time_split"]["accept"] / e["time_split"]["total"])
                assert e["sampling"]["temperature"] == float(t), name
    table = (tmp_path / "results.md").read_text()
    for t in ("0.8", "0.3"):
        section = table.split(f"### Sampled at temperature {t} ")[1].split("###")[0]
        assert "× vanilla_sample" in section and "| dynamic_sample |" in section and "%" in section
    for name, e in saved["methods"].items():
        for key in ("tokens_per_s", "tau", "speedup", "identical_to_vanilla", "new_tokens", "time_split"):
            assert key in e, (name, key)
        assert e["tokens_per_s"] > 0 and e["tau"] >= 1.0 and e["speedup"] > 0 and e["new_tokens"] > 0
        assert e["time_split"]["total"] > 0
        assert e["identical_to_vanilla"] is True, (name, e.get("mismatches"))
    assert saved["methods"]["vanilla"]["speedup"] == pytest.approx(1.0)
    assert saved["methods"]["vanilla"]["tau"] == 1.0
    assert saved["methods"]["dynamic"]["time_split"]["verify"] > 0
    assert saved["methods"]["learned"]["tree_size"] == 5
    for name, e in saved["methods"].items():  # ops per step, from one untimed counted run per treedec method
        if e["family"] == "treedec":
            assert e["aten_ops_per_step"] > 0 and e["host_reads_per_step"] > 0, name
            assert e["op_counts"]["steps"] >= 1 and e["op_counts"]["aten_ops_total"] > e["aten_ops_per_step"]
        else:
            assert "host_reads_per_step" not in e, name
    for name in ("chain", "static", "dynamic_raw", "dynamic", "auto", "learned"):  # issue 11: at most 4 host reads per speculative step
        assert saved["methods"][name]["host_reads_per_step"] <= 4, (name, saved["methods"][name]["op_counts"])
    assert saved["methods"]["vanilla"]["host_reads_per_step"] <= 2
    assert saved["methods"]["hf_assisted"]["assistant_layers"] == 1
    assert saved["machine"]["threads"] == 1 and saved["machine"]["torch"] == torch.__version__
    assert saved["machine"]["draft_dtype"] in ("float32", "bfloat16")  # as loaded: dtype=auto is measured
    assert saved["machine"]["draft_wide_rows"] in (None, 8, 16, 32)  # and the batch from which its bf16 twin drafts
    assert saved["prompts"]["ids"] == ["add", "p1"] and saved["failures"] == []
    assert saved["config"]["bench"]["max_new_tokens"] == 12
    table = (tmp_path / "results.md").read_text()
    assert "| dynamic |" in table and "speedup ÷ τ" in table
    for name in ("dynamic_raw", "dynamic", "auto", "static"):  # issue 15: tree size and histogram per tree
        e = saved["methods"][name]
        assert sum(e["accepted_hist"].values()) > 0 and 1 <= e["mean_tree_size"] <= e["tree_size"], name
    assert saved["methods"]["dynamic"]["mean_tree_size"] == pytest.approx(8.0)
    # tree=auto's shapes: the root alone, a chain of each depth (T = depth + 1), trees of a few sizes
    assert {a["total_tokens"] for a in saved["methods"]["auto"]["auto_arms"]} <= {1, 2, 3, 4, 8, 12, 16}
    assert "accepted length histogram" in table and "auto: T" in table
    assert 0 <= saved["methods"]["lookup"]["copy_alone_share"] <= 1 and "copies alone on" in table
    assert "host reads/step | aten ops/step |" in table
    row = next(ln for ln in table.splitlines() if ln.startswith("| dynamic |") and "%" in ln).split("|")
    assert float(row[-3]) == pytest.approx(saved["methods"]["dynamic"]["host_reads_per_step"], abs=0.05)
    lines = [json.loads(ln) for ln in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    n_sampled = sum(len(g["methods"]) for g in saved["sampled"].values())
    assert len(lines) == 2 * (len(names) + n_sampled)
    assert {ln["temperature"] for ln in lines if "temperature" in ln} == {0.8, 0.3}


def test_dynamic_sweep_puts_tree_auto_on_the_fixed_budget_curve(stack, tmp_path):
    m = harness.run(bench_cfg(stack, tmp_path, "bench.methods=[vanilla,auto]", "bench.peers=[]",
                              "bench.repeats=1", "bench.dynamic_sweep=[8,16]", "bench.plots=true"))
    assert m["dynamic_sweep"] == {"methods": ["dynamic_T8", "dynamic_T16"], "auto": ["auto"]}
    for T in (8, 16):
        e = m["methods"][f"dynamic_T{T}"]
        assert e["identical_to_vanilla"] is True and e["mean_tree_size"] == pytest.approx(T)
        assert e["tree_size"] == T and e["tree_depth"] == 3  # bench.trees.dynamic at a fixed T
    assert (tmp_path / "budget_sweep.png").is_file()


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
    args = bench_overrides(stack, tmp_path, "bench.methods=[vanilla,chain,dynamic]", "bench.peers=[]",
                           "bench.repeats=1", "bench.plots=true")
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
    from treedec.config import ConfigError

    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    cases = [
        ("+bench.max_new_token=999", r"unknown key bench\.max_new_token; "
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
        ("bench.trees.dynamic.total_tokens=1", r"invalid bench\.trees\.dynamic config: tree\.total_tokens=1 must be a whole number >= 2"),
    ]
    for override, needle in cases:
        cfg = bench_cfg(stack, tmp_path, "model.path=/nonexistent/model", override)
        with pytest.raises(ConfigError, match=needle):
            harness.run(cfg)
    assert not (tmp_path / "metrics.json").exists()


def test_third_party_prompts_are_recorded(stack, tmp_path):
    """bench.prompt_source=third_party: prompts from installed packages, each one's file and line in metrics.json."""
    cfg = bench_cfg(stack, tmp_path, "bench.prompts=null", "bench.prompt_source=third_party", "bench.n_prompts=2",
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
    from scripts.gpu import pytest_status

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
    assert table["tied"]["tie_flips"] == 2 and table["real"]["tie_flips"] == 1 and table["peer"]["tie_flips"] == 0
    assert classify_mismatches({"tied": entry([0.0])}, tie_ulps=0.0) == []  # an exact tie is a tie even at 0
    assert classify_mismatches({"tied": entry([0.01])}, tie_ulps=0.0) == ["differs"]


# ------------------------------------------------------------------ the defaults: the whole field with no flag
def test_defaults_run_learned_and_hf_assisted_on_third_party_prompts(tmp_path):
    """`python -m treedec.bench` as is: third-party prompts, the shipped learned tree, the bundled assistant."""
    from treedec.config import bundled

    cfg = compose_config("bench", [f"paths.run_dir={tmp_path}"])
    assert cfg.bench.prompt_source == "third_party" and "learned" in cfg.bench.methods
    assert "hf_assisted" in cfg.bench.peers
    why = bm.resolve_auto(cfg)
    assert cfg.bench.learned_path == str(bundled.LEARNED_TREE) and bundled.LEARNED_TREE.is_file()
    assert cfg.bench.trees.learned.path == str(bundled.LEARNED_TREE)  # the policy reads the resolved file
    assert cfg.bench.assistant_path == "tiny-code-assistant" and "auto" in why["hf_assisted"]
    assert bm.build_policies(cfg)["learned"].max_size > 1


def test_auto_is_off_for_other_checkpoints(stack, tmp_path):
    """auto keeps today's behaviour for a head or target of your own: learned and hf_assisted are skipped, with why."""
    cfg = bench_cfg(stack, tmp_path, "bench.learned_path=auto", "bench.assistant_path=auto",
                    "bench.methods=[vanilla,chain,learned]", "bench.peers=[hf_assisted]", "bench.repeats=1")
    m = harness.run(cfg)  # (a bench whose every tree method is skipped is an error: chain runs beside)
    assert set(m["methods"]) == {"vanilla", "chain"}
    assert "only for the bundled head tiny-code-eagle" in m["skipped"]["learned"]
    assert "only for the bundled tiny-code" in m["skipped"]["hf_assisted"]
    assert m["config"]["bench"]["learned_path"] is None and m["config"]["bench"]["assistant_path"] is None


def test_shipped_learned_tree_fits_the_bundled_head():
    """The asset is a calibrated tree for tiny-code + tiny-code-eagle and says which command made it."""
    import yaml

    from treedec.config.bundled import LEARNED_TREE
    from treedec.tree.policies import LearnedPolicy

    data = yaml.safe_load(LEARNED_TREE.read_text())
    cal = data["calibration"]
    assert cal["model"] == "tiny-code" and cal["draft"] == "tiny-code-eagle"
    assert cal["command"].startswith("python -m treedec.calibrate") and cal["machine_note"]
    assert "python -m treedec.calibrate" in LEARNED_TREE.read_text().split("\nname:")[0]  # the header
    vocab = json.loads((LEARNED_TREE.parents[1] / "tiny-code" / "config.json").read_text())["vocab_size"]
    policy = LearnedPolicy(str(LEARNED_TREE))
    policy.validate(vocab)
    assert policy.max_size == data["budget"] and policy.max_depth == data["depth"]


def test_bundled_assistant_auto_runs_and_missing_one_is_skipped(stack, tmp_path, monkeypatch):
    """model.path=tiny-code with assistant_path=auto loads `tiny-code-assistant`; absent, it is skipped (no crash)."""
    from treedec.models import checkpoint

    monkeypatch.setitem(checkpoint.BUNDLED, "tiny-code", stack / "target")
    monkeypatch.setitem(checkpoint.BUNDLED, "tiny-code-assistant", stack / "assistant")
    args = ("model.path=tiny-code", "bench.assistant_path=auto", "bench.methods=[vanilla]", "bench.peers=[hf_assisted]",
            "bench.repeats=1")
    m = harness.run(bench_cfg(stack, tmp_path / "a", *args))
    e = m["methods"]["hf_assisted"]
    assert e["assistant_path"] == str(stack / "assistant") and e["assistant_layers"] == 1
    assert e["identical_to_vanilla"] is True and m["config"]["bench"]["assistant_path"] == "tiny-code-assistant"

    monkeypatch.setitem(checkpoint.BUNDLED, "tiny-code-assistant", tmp_path / "absent")
    m = harness.run(bench_cfg(stack, tmp_path / "b", *args))
    assert "hf_assisted" not in m["methods"]
    assert "model_arch=tiny_code_assistant" in m["skipped"]["hf_assisted"]
    assert "hf_assisted" in (tmp_path / "b" / "results.md").read_text()  # the Skipped line says why


def test_assistant_of_another_vocabulary_is_skipped(stack, tmp_path, tokenizer):
    other = Transformer(LlamaConfig(**{**TINY_ARCH, "vocab_size": 400, "num_hidden_layers": 1}), "sdpa")
    save_pretrained(other, tmp_path / "other", tokenizer=str(tokenizer[0]))
    m = harness.run(bench_cfg(stack, tmp_path, f"bench.assistant_path={tmp_path / 'other'}",
                              "bench.methods=[vanilla]", "bench.peers=[hf_assisted]", "bench.repeats=1"))
    assert "hf_assisted" not in m["methods"] and "vocab_size 400" in m["skipped"]["hf_assisted"]


# ------------------------------------------------------------------ compile variants: compile time kept apart
def _fake(name: str, compiled: bool, compile_cost: float = 0.0, reference: str = "vanilla") -> bm.Method:
    calls = []

    def fn(p, seed):
        calls.append(p.id)
        if compiled and len(calls) == 1:
            time.sleep(compile_cost)  # the first call compiles
        return bm.RunOutput([1, 2, 3], 3, 3, 4)

    m = bm.Method(name, "treedec", True, fn, compiled=compiled, reference=reference)
    m.calls = calls
    return m


def test_compile_time_is_paid_by_the_warm_up_and_kept_out_of_the_timed_runs(monkeypatch):
    prompts = [bm.Prompt("a", "x", [1]), bm.Prompt("b", "y", [2])]
    van, comp = _fake("vanilla", False), _fake("vanilla_compile", True, 0.3)
    graphs = iter(range(100))
    monkeypatch.setattr(timing, "_graphs_compiled", lambda: 0)
    res = timing.time_methods([van, comp], prompts, repeats=1, warmup=0, seed=0, device=torch.device("cpu"))
    assert van.calls == ["a", "b"] and comp.calls == ["a", "a", "b"]  # warmup=0: only the compiled one warms up
    assert res["vanilla_compile"]["compile_s"] >= 0.3 and res["vanilla_compile"]["times"][0] < 0.3
    assert res["vanilla_compile"]["graphs_in_timed"] == 0
    table, _ = harness.summarize([van, comp], prompts, res)
    assert table["vanilla_compile"]["compile_s"] >= 0.3 and "compile_s" not in table["vanilla"]

    monkeypatch.setattr(timing, "_graphs_compiled", lambda: next(graphs))  # a graph built inside every call
    res = timing.time_methods([van, comp], prompts, repeats=1, warmup=1, seed=0, device=torch.device("cpu"))
    assert res["vanilla_compile"]["graphs_in_timed"] == 2 and res["vanilla"]["graphs_in_timed"] == 0


def test_compiled_tree_methods_are_checked_against_compiled_vanilla():
    prompts = [bm.Prompt("a", "x", [1])]
    van, vc = _fake("vanilla", False), _fake("vanilla_compile", True)
    chain = _fake("chain_compile", True, reference="vanilla_compile")
    res = timing.time_methods([van, vc, chain], prompts, repeats=1, warmup=0, seed=0, device=torch.device("cpu"),
                               ops=False)
    res["vanilla_compile"]["outputs"][0].tokens = [1, 2, 4]  # compiled kernels parted from eager ones...
    res["chain_compile"]["outputs"][0].tokens = [1, 2, 4]  # ... and the compiled tree follows compiled vanilla
    vc.lossless = False  # as build_methods sets it outside fp32
    table, failures = harness.summarize([van, vc, chain], prompts, res)
    assert table["chain_compile"]["identical_to_vanilla"] is True
    assert table["chain_compile"]["checked_against"] == "vanilla_compile"
    assert table["vanilla_compile"]["identical_to_vanilla"] is False and failures == []
    assert table["chain_compile"]["speedup"] == pytest.approx(
        table["chain_compile"]["tokens_per_s"] / table["vanilla_compile"]["tokens_per_s"])
    res["chain_compile"]["outputs"][0].tokens = [1, 2, 3]  # now it differs from its reference: a lossless failure
    _, failures = harness.summarize([van, vc, chain], prompts, res)
    assert failures and "differs from vanilla_compile" in failures[0]


@pytest.mark.slow
def test_bench_compile_runs_compiled_variants(stack, tmp_path):
    """bench.compile=true: vanilla_compile and chain_compile decode like eager vanilla (fp32), compile time apart."""
    m = harness.run(bench_cfg(stack, tmp_path, "bench.compile=true", "bench.methods=[vanilla,chain]",
                              "bench.peers=[]", "bench.repeats=1", "bench.warmup=0"))
    assert {"vanilla", "vanilla_compile", "chain", "chain_compile"} <= set(m["methods"])
    for name in ("vanilla_compile", "chain_compile"):
        e = m["methods"][name]
        assert e["compile"] is True and e["compile_s"] > 0 and e["identical_to_vanilla"] is True, name
        assert e["graphs_compiled_in_timed_runs"] == 0, name  # compilation never leaks into tok/s
        assert e["host_reads_per_step"] is None and "torch.compile" in e["op_counts"]["skipped"], name
    assert m["methods"]["chain_compile"]["checked_against"] == "vanilla_compile" and m["failures"] == []
    assert "compile s" in (tmp_path / "results.md").read_text()


# ------------------------------------------------------------------ sampled rows: temperatures and hf_sample
def test_sample_temperatures_option(stack, tmp_path):
    """bench.sample_temperatures sets the sampled rows; bad lists fail before the model loads."""
    from treedec.config import ConfigError

    cfg = bench_cfg(stack, tmp_path, "bench.sampling=true", "bench.sample_temperatures=[0.5]", "sampling.top_p=0.9")
    assert [(s.temperature, s.top_p) for s in bm.sample_settings(cfg)] == [(0.5, 0.9)]
    cfg = bench_cfg(stack, tmp_path, "bench.sampling=true", "bench.sample_temperatures=null",
                    "sampling.temperature=0.7")
    assert [s.temperature for s in bm.sample_settings(cfg)] == [0.7]  # null: the group's own
    assert bm.sample_settings(bench_cfg(stack, tmp_path)) == []  # bench.sampling=false
    for override, needle in [("bench.sample_temperatures=[0.8,0]", r"has 0\.0: every temperature must be > 0"),
                             ("bench.sample_temperatures=[]", r"at least one temperature"),
                             ("bench.sample_temperatures=[0.3,0.3]", r"repeats a temperature")]:
        with pytest.raises(ConfigError, match=needle):
            harness.run(bench_cfg(stack, tmp_path, "model.path=/nonexistent/model", "bench.sampling=true",
                                  override))


def test_hf_sample_is_seeded_and_runs_only_when_sampling(stack, tmp_path):
    from treedec.bench import peers

    cfg = bench_cfg(stack, tmp_path, "bench.sampling=true", "bench.sample_temperatures=[50.0]",
                    "bench.peers=[hf_greedy,hf_sample]", "bench.max_new_tokens=16")
    from treedec.cli import load_stack

    target, tok, _ = load_stack(cfg)
    methods, skipped = peers.build_peers(cfg, target, list(tok.eos_ids) or list(target.config.eos_ids))
    by_name = {m.name: m for m in methods}
    assert set(by_name) == {"hf_greedy", "hf_sample@50"} and not skipped
    hs = by_name["hf_sample@50"]
    assert hs.greedy is False and hs.reference == "vanilla_sample@50" and hs.info["sampling"]["top_k"] == 0
    p = bm.Prompt("a", "", [5, 6, 7])
    state = torch.get_rng_state()
    runs = [hs(p, seed).tokens for seed in (3, 3, 4, 5, 6)]
    assert torch.equal(torch.get_rng_state(), state)  # fork_rng: the process's random state is untouched
    assert runs[0] == runs[1] and len(runs[0]) > 0  # the same seed, the same sample
    assert any(r != runs[0] for r in runs[2:]), runs  # other seeds, other samples (T=50: the random model is peaked)
    greedy_cfg = bench_cfg(stack, tmp_path, "bench.peers=[hf_sample]")
    assert peers.build_peers(greedy_cfg, target, [0]) == ([], {})  # nothing to match without sampled rows


def test_vanilla_fp32_reference_is_reported_never_checked(stack, tmp_path):
    m = harness.run(bench_cfg(stack, tmp_path, "bench.methods=[vanilla,chain]", "bench.peers=[]",
                              "bench.vanilla_fp32=true", "bench.learned_path=null"))
    e = m["methods"]["vanilla_fp32"]
    assert e["tokens_per_s"] > 0 and e["tau"] == 1.0 and e["speedup"] > 0
    assert e["identical_to_vanilla"] is True  # an fp32 target: its fp32 copy decodes the same tokens
    assert not e.get("lossless_check") and m["failures"] == []


def test_vanilla_fp32_auto_runs_only_for_a_low_precision_cpu_target():
    from omegaconf import OmegaConf

    t = Transformer(LlamaConfig(**TINY_ARCH), "sdpa")
    auto = OmegaConf.create({"vanilla_fp32": "auto"})
    assert not bm.fp32_reference(auto, t)  # already fp32
    assert bm.fp32_reference(auto, t.to(torch.bfloat16))
    assert not bm.fp32_reference(OmegaConf.create({"vanilla_fp32": False}), t)
    from treedec.sampling import SamplingParams

    ref = bm.vanilla_fp32_method(t, 4, SamplingParams(), [0])
    assert ref.lossless is False and ref.info["dtype"] == "float32"
    assert t.dtype == torch.bfloat16  # the benchmarked target itself is untouched
