"""calibrate -> learned tree -> generate on a tiny random model; calibrate's config and errors."""
from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import compose_config, generate_overrides


def calib_overrides(stack, run_dir, *extra):
    return [f"model.path={stack / 'target'}", "model.dtype=float32", f"draft.path={stack / 'draft'}",
            f"paths.run_dir={run_dir}", "probe.top_k=3", "probe.depth=3", "prompts.n=2", "prompts.prompt_tokens=32",
            "max_new_tokens=12", "dp.max_budget=12", "dp.max_depth=3", "timing.repeats=1", "timing.warmup=0",
            "timing.budgets=[2,6,12]", "timing.prefix_len=32", "num_threads=1", *extra]


def test_calibrate_then_generate_with_learned_tree(stack, tmp_path, corpus, capsys):
    from treedec.calibrate import run
    from treedec.generate import run as generate

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n" + json.dumps("class Thing:\n") + "\n")
    cdir = tmp_path / "calib"
    m = run(compose_config("calibrate", calib_overrides(stack, cdir, "prompts.source=file", f"prompts.file={prompts}")))
    out = cdir / "learned_tree.yaml"
    assert m["out"] == str(out) and out.is_file() and (cdir / "metrics.json").is_file()
    shape = yaml.safe_load(out.read_text())
    assert shape["budget"] == len(shape["choices"]) + 1 == m["budget"] and 2 <= m["budget"] <= 12
    assert shape["depth"] <= 3 and shape["expected_tau"] >= 1.0
    assert set(shape["timing"]["t_verify_ms"]) >= {2, 6, 12} and shape["timing"]["t_draft_ms"] > 0
    assert sorted(shape["trees"]) == list(range(2, 13))
    acc = json.loads((cdir / "acceptance.json").read_text())
    assert acc["steps"] == m["steps"] > 0 and len(acc["trials"][0]) == 3  # a random draft rarely gets past depth 1
    assert [f["budget"] for f in m["frontier"]] == [2, 6, 12]
    assert "tree=learned tree.path=" in capsys.readouterr().out
    # the draft's calibration: beside the shape file, monotone per depth, the rule recorded; a diagram in the run dir
    cal_file = cdir / "calibration.yaml"
    assert m["calibration"] == str(cal_file) and (cdir / "reliability.png").is_file()
    cal = yaml.safe_load(cal_file.read_text())
    assert cal["mode"]["rule"] == "greedy" and len(cal["values"]) == 3 and cal["trials_by_depth"][0] > 0
    assert all(b >= a for row in cal["values"] for a, b in zip(row, row[1:]))
    assert cal["map"] == "power" and len(cal["power"]) == 3 and all(b > 0 for _, b in cal["power"])  # the one applied

    gdir = tmp_path / "gen"
    cfg = compose_config("generate", generate_overrides(stack, gdir, "tree=learned", f"tree.path={out}", "compare=true",
                                                        "stream=false"))
    g = generate(cfg)
    assert g["identical_to_vanilla"] is True and g["new_tokens"] > 0
    cfg = compose_config("generate", generate_overrides(stack, gdir, "tree=learned", f"tree.path={out}",
                                                        "tree.total_tokens=5", "stream=false"))
    from hydra.utils import instantiate

    assert instantiate(cfg.tree).max_size == 5
    # tree=auto reads the calibration.yaml beside its head (tree.draft_path, the draft group's head by default)
    for extra in (["tree=dynamic", f"tree.calibration={cal_file}"], ["tree=auto", f"tree.draft_path={cal_file.parent}"]):
        cfg = compose_config("generate", generate_overrides(stack, gdir, "compare=true", "stream=false", *extra))
        assert instantiate(cfg.tree).calibration is not None
        assert generate(cfg)["identical_to_vanilla"] is True

    # heldout prompts from a corpus's validation split, fixed budget, no timing
    hdir = tmp_path / "heldout"
    m2 = run(compose_config("calibrate", calib_overrides(stack, hdir, f"prompts.root={corpus}",
                                                         "prompts.val_fraction=0.5", "timing.enabled=false",
                                                         "dp.budget=7", "dp.per_depth=false",
                                                         f"out={tmp_path / 'fixed.yaml'}")))
    assert m2["budget"] == 7 and m2["prompts"] == 2 and m2["expected_tokens_per_s"] is None
    assert yaml.safe_load((tmp_path / "fixed.yaml").read_text())["timing"] is None


def test_probe_recovers_oracle_acceptance():
    """With an oracle that makes each drafted child correct with probability 0.7 (independently), the probe
    measures p[rank] ~ 0.7 at every rank, and the DP's expected tau for the probe tree matches the run's."""
    from tests.helpers import OraclePolicy, greedy_reference, make_pair
    from treedec.probe.acceptance import probe_acceptance
    from treedec.sampling import SamplingParams
    from treedec.tree.sequoia import AcceptanceCounts, comb_probe, expected_accepted

    target, draft = make_pair(seed=3)
    total = AcceptanceCounts()
    for i in range(3):
        prompt = [(7 * i + j) % 64 for j in range(5)]
        ref = greedy_reference(target, prompt, 80)
        oracle = OraclePolicy(comb_probe(3, 3), [ref], p_hit=0.7, seed=i)
        counts, stats, rel = probe_acceptance(target, draft, oracle, SamplingParams(), [prompt], 60, [], 0,
                                              stream=oracle.stream)
        conf, lab, cnt = rel.result()  # greedy edge labels (the oracle may repeat a sibling: >=)
        assert sum(map(sum, lab)) >= sum(k * v for k, v in stats["accepted_hist"].items())
        assert sum(cnt[0]) == 3 * stats["row_steps"]  # every step tries the root's 3 children
        for k, v in counts.hits.items():
            total.hits[k] = total.hits.get(k, 0) + v
        for k, v in counts.trials.items():
            total.trials[k] = total.trials.get(k, 0) + v
        total.steps += counts.steps
        total.accepted += counts.accepted
    assert total.pooled()[:2] == pytest.approx([0.7, 0.7], abs=0.12)
    # distinct siblings: exactly one tried child per accepted non-final node is the target's argmax
    _, stats, rel = probe_acceptance(target, draft, comb_probe(3, 3), SamplingParams(), [prompt], 40, [], 0)
    assert sum(map(sum, rel.result()[1])) == sum(k * v for k, v in stats["accepted_hist"].items())
    exp_tau = expected_accepted(comb_probe(3, 3).shape, total.rates(per_depth=True)) + 1
    assert exp_tau == pytest.approx(total.as_dict()["tau"], abs=0.25)


def test_calibrate_config_errors(stack, tmp_path):
    from treedec.calibrate import run
    from treedec.config import ConfigError

    with pytest.raises(Exception, match="dp.max_budget"):
        compose_config("calibrate", calib_overrides(stack, tmp_path, "dp.max_budget=lots"))
    with pytest.raises(Exception, match="top_kk"):
        compose_config("calibrate", calib_overrides(stack, tmp_path, "probe.top_kk=3"))
    with pytest.raises(ConfigError, match="probe.top_kk"):  # appended keys pass Hydra; the schema stops them
        run(compose_config("calibrate", calib_overrides(stack, tmp_path, "+probe.top_kk=3", "model.path=/nonexistent")))
    with pytest.raises(FileNotFoundError, match="prompts.file"):
        run(compose_config("calibrate", calib_overrides(stack, tmp_path, "prompts.source=file",
                                                        f"prompts.file={tmp_path / 'none.jsonl'}")))


@pytest.mark.parametrize("override,needle", [
    ("dp.max_budget=1", r"dp\.max_budget=1: must be >= 2 \(T counts the root"),
    ("prompts.n=0", r"prompts\.n=0: must be >= 1"),
    ("dp.budget=40", r"dp\.budget=40 must be in \[2, dp\.max_budget=12\]"),
    ("dp.depth=9", r"dp\.depth=9 must be in \[1, dp\.max_depth=3\]"),
    ("timing.budgets=[2,99]", r"timing\.budgets has 99: every budget must be in \[2, dp\.max_budget=12\]"),
    ("num_threads=-1", r"num_threads=-1: must be >= 1"),
    ("prompts.source=pypi", r"prompts\.source='pypi'; choose one of heldout, third_party, file"),
    ("prompts.source=file", r"prompts\.source=file needs prompts\.file="),
    ("+dp.max_budgte=3", r"dp\.max_budgte.*Did you mean dp\.max_budget\? Keys of dp: max_budget, max_depth"),
    ("model.dtype=bf17", r"invalid model\.dtype: unknown dtype 'bf17'"),
])
def test_calibrate_rejects_bad_options_before_loading(stack, tmp_path, override, needle):
    from treedec.calibrate import run
    from treedec.config import ConfigError

    with pytest.raises(ConfigError, match=needle):  # the model path does not exist: nothing loaded
        run(compose_config("calibrate", calib_overrides(stack, tmp_path, "model.path=/nonexistent/model", override)))


def test_malformed_prompts_file_names_path_and_line(stack, tmp_path):
    from treedec.calibrate import run
    from treedec.config import ConfigError

    f = tmp_path / "prompts.jsonl"
    f.write_text('"def f(x):\\n"\n{"prompt": "def g(\n')
    with pytest.raises(ConfigError, match=r"prompts\.jsonl:2: not valid JSON \(.*column \d+.*\); write one prompt per line"):
        run(compose_config("calibrate", calib_overrides(stack, tmp_path, "model.path=/nonexistent/model",
                                                        "prompts.source=file", f"prompts.file={f}")))


def test_calibrate_on_third_party_prompts(stack, tmp_path):
    """prompts.source=third_party: code the bundled model never saw; each prompt's file is recorded."""
    from treedec.calibrate import run

    m = run(compose_config("calibrate", calib_overrides(stack, tmp_path, "prompts.source=third_party",
                                                        "timing.enabled=false", "dp.budget=5", "max_new_tokens=6")))
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert m["prompts"] == 2 and len(saved["prompt_sources"]) == 2
    assert all("site-packages" in s["file"] for s in saved["prompt_sources"].values())
    assert yaml.safe_load((tmp_path / "learned_tree.yaml").read_text())["budget"] == 5


def test_calibrate_a_one_pass_head_writes_its_calibration_and_best_first_reads_it(tmp_path, capsys):
    """A one-pass head: a best-first probe as deep as its block, calibration.yaml alone (no learned shape), and
    tree=best_first ranks paths by it (its scores are the calibrated acceptances, its drafts stay lossless)."""
    import torch

    from treedec.calibrate import run
    from treedec.decoding.speculative import SpeculativeDecoder
    from treedec.heads import load_head
    from treedec.models import load_model
    from treedec.tree.calibration import load_calibration
    from treedec.tree.policies import BestFirstPolicy

    m = run(compose_config("calibrate", ["draft=tiny_code_parallel", f"paths.run_dir={tmp_path}", "prompts.n=2",
                                         "prompts.prompt_tokens=48", "max_new_tokens=24", "dp.max_budget=24",
                                         "num_threads=1"]))
    cal_file = tmp_path / "calibration.yaml"
    assert m["out"] is None and m["calibration"] == str(cal_file) and not (tmp_path / "learned_tree.yaml").exists()
    cal = load_calibration(cal_file)
    assert cal.depth == 8 and cal.meta["trials_by_depth"][0] > 0  # every depth of the block measured
    assert "tree=best_first tree.calibration=" in capsys.readouterr().out
    target = load_model("tiny-code", dtype=torch.float32)
    head = load_head("tiny-code-parallel", target=target, dtype=torch.float32)
    prompt = [list(range(40, 80))]
    policy = BestFirstPolicy(16, 8, calibration=str(cal_file))
    assert policy.calibration is not None and policy.calibration.depth == 8
    raw = SpeculativeDecoder(target, head, BestFirstPolicy(16, 8, calibration=None)).generate(prompt, 24)
    assert SpeculativeDecoder(target, head, policy).generate(prompt, 24).tokens == raw.tokens  # lossless either way
