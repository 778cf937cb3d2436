"""Draft calibration maps (monotone, device lookup = host interpolation, files) and the calibrated dynamic tree."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from tests.decoding.test_policies import primed_drafter
from tests.helpers import random_calibration
from treedec.tree import Tree, TreeError
from treedec.tree.calibration import (
    FLOOR,
    GRID,
    Calibration,
    Reliability,
    fit,
    fit_power,
    isotonic,
    load_calibration,
    resolve,
    save_calibration,
)
from treedec.tree.policies import AutoPolicy, DynamicPolicy


@pytest.mark.parametrize("seed", range(5))
def test_fit_is_monotone_and_recovers_a_known_acceptance_curve(seed):
    """Edges drawn with acceptance sqrt(q) at depth 1 and q**2 at depth 2: the isotonic fit follows them."""
    rng = np.random.default_rng(seed)
    truth = [np.sqrt, np.square]
    nb = len(GRID) - 1
    conf, lab, cnt = np.zeros((2, nb)), np.zeros((2, nb)), np.zeros((2, nb))
    for d, f in enumerate(truth):
        q = rng.uniform(0, 1, 20000)
        hit = rng.uniform(0, 1, q.size) < f(q)
        b = np.searchsorted(GRID[1:-1], q, side="right")
        np.add.at(conf[d], b, q), np.add.at(lab[d], b, hit), np.add.at(cnt[d], b, 1)
    vals = fit(conf.tolist(), lab.tolist(), cnt.tolist())
    for d, f in enumerate(truth):
        assert all(b >= a for a, b in zip(vals[d], vals[d][1:]))  # monotone
        assert all(FLOOR <= v <= 1.0 for v in vals[d])
        mid = [i for i, x in enumerate(GRID) if 0.1 <= x <= 0.9]
        assert np.allclose([vals[d][i] for i in mid], f(np.array([GRID[i] for i in mid])), atol=0.06)


@pytest.mark.parametrize("seed", range(3))
def test_power_fit_recovers_a_power_law_and_falls_back_to_the_identity(seed):
    """Edges accepted with probability min(1, 1.6 q^1.3) at depth 1, 0.9 q^0.7 at depth 2: the log-log fit finds both;
    a depth with too few confident bins is the identity (raw draft probabilities)."""
    rng = np.random.default_rng(seed)
    truth = [(np.log(1.6), 1.3), (np.log(0.9), 0.7), None]
    nb = len(GRID) - 1
    conf, lab, cnt = np.zeros((3, nb)), np.zeros((3, nb)), np.zeros((3, nb))
    for d, ab in enumerate(truth):
        q = rng.uniform(0, 1, 40000) if ab else rng.uniform(0, 0.015, 100)
        p = np.minimum(1.0, np.exp(ab[0]) * q ** ab[1]) if ab else q
        b = np.searchsorted(GRID[1:-1], q, side="right")
        np.add.at(conf[d], b, q), np.add.at(lab[d], b, rng.uniform(0, 1, q.size) < p), np.add.at(cnt[d], b, 1)
    got = fit_power(conf.tolist(), lab.tolist(), cnt.tolist(), prior_strength=0.0, qmin=0.02)
    assert got[2] == [0.0, 1.0]
    # depth 1 saturates at 1 from q ~0.7 on, which bends the log-log line: a looser check there
    assert got[0][1] == pytest.approx(1.3, abs=0.25) and got[1] == pytest.approx([np.log(0.9), 0.7], abs=0.06)
    cal = Calibration([[max(g, FLOOR) for g in GRID]] * 3, power=got)
    assert cal.map == "power" and cal(0.5, 2) == pytest.approx(min(1.0, np.exp(got[1][0]) * 0.5 ** got[1][1]), rel=1e-5)


def test_isotonic_pools_violators_and_an_empty_bin_is_the_identity():
    assert isotonic([0.1, 0.5, 0.3, 0.9], [1, 1, 1, 1]) == pytest.approx([0.1, 0.4, 0.4, 0.9])
    assert isotonic([0.8, 0.2], [3, 1]) == pytest.approx([0.65, 0.65])
    nb = len(GRID) - 1
    vals = fit([[0.0] * nb], [[0.0] * nb], [[0] * nb])  # no data: shrunk to the identity
    assert np.allclose(vals[0][1:], GRID[1:], atol=0.03)


@pytest.mark.parametrize("seed", range(4))
def test_power_map_is_monotone_clamped_and_the_same_per_depth_or_per_element(seed):
    cal = random_calibration(seed, map="power")
    q = torch.rand(4000, generator=torch.Generator().manual_seed(seed)).sort().values.clamp(min=1e-6)
    for depth in (1, 2, 4, 9):  # deeper than the table: its deepest row
        a, b = cal.power[min(depth, cal.depth) - 1]
        got = cal.log_accept(q.log(), depth)
        want = (a + b * q.double().log()).clamp(np.log(FLOOR), 0.0)
        assert torch.allclose(got.double(), want, atol=1e-5) and bool((got <= 0).all())
        assert bool((got[1:] >= got[:-1] - 1e-6).all())
        per_elem = cal.log_accept(q.log(), torch.full(q.shape, depth))
        assert torch.allclose(per_elem, got, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_device_lookup_is_monotone_and_matches_host_interpolation(seed):
    cal = random_calibration(seed)
    q = torch.rand(4000, generator=torch.Generator().manual_seed(seed)).sort().values.clamp(min=1e-6)
    for depth in (1, 2, 4, 9):  # deeper than the table: its deepest row
        got = cal.log_accept(q.log(), depth).exp()
        row = cal.values[min(depth, cal.depth) - 1]
        assert torch.allclose(got, torch.tensor(np.interp(q.numpy(), GRID, row), dtype=torch.float32), atol=1e-5)
        assert bool((got[1:] >= got[:-1] - 1e-6).all()) and bool((got <= 1.0).all())
        assert bool((cal.log_accept(q.log(), depth) <= 0).all())


def test_calibration_file_round_trip_and_clear_errors(tmp_path):
    cal = random_calibration(0)
    cal.meta["mode"] = {"rule": "greedy"}
    p = save_calibration(tmp_path / "c" / "calibration.yaml", cal)
    back = load_calibration(p)
    assert np.allclose(back.values, cal.values) and back.meta["mode"]["rule"] == "greedy"
    assert back.map == "isotonic" and np.allclose(back.power, cal.power)  # both fits kept, the choice too
    assert load_calibration(save_calibration(tmp_path / "p.yaml", random_calibration(0, map="power"))).map == "power"
    with pytest.raises(TreeError, match="exponent > 0"):
        Calibration(cal.values, power=[[0.0, -1.0]] * cal.depth)
    with pytest.raises(TreeError, match="calibration map 'cubic'"):
        Calibration(cal.values, power=cal.power, map="cubic")
    with pytest.raises(TreeError, match="power needs a 'power' table"):
        Calibration(cal.values, map="power")
    with pytest.raises(TreeError, match="not found"):
        load_calibration(tmp_path / "missing.yaml")
    with pytest.raises(TreeError, match="non-decreasing"):
        Calibration([[1.0] + [0.5] * (len(GRID) - 1)])
    old = tmp_path / "old.yaml"  # a file written before the power map: its isotonic table applies
    old.write_text(yaml.dump({"grid": list(GRID), "values": cal.values}))
    assert load_calibration(old).map == "isotonic" and load_calibration(old).power is None
    (tmp_path / "bad.yaml").write_text("grid: [0, 1]\n")
    with pytest.raises(TreeError, match="values"):
        load_calibration(tmp_path / "bad.yaml")
    assert resolve(None) is None and resolve("auto", tmp_path) is None  # a head directory without one: raw
    (tmp_path / "calibration.yaml").write_text(p.read_text())
    assert np.allclose(resolve("auto", tmp_path).values, cal.values)
    shipped = resolve("auto", "tiny-code-eagle")  # the bundled head ships its calibration
    assert shipped is not None and shipped.meta["mode"]["rule"] == "greedy" and shipped.map == "power"
    assert shipped.meta["prompt_source"] == "heldout"  # fitted on held-out stdlib prompts, not the bench's


def test_reliability_bins_tried_edges_by_depth_and_confidence():
    rel = Reliability(2, "cpu")
    logq = torch.tensor([[0.0, 0.91, 0.32, 0.05]]).clamp(min=1e-9).log()
    label = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    depth = torch.tensor([[0, 1, 1, 2]])
    tried = torch.tensor([[False, True, True, False]])
    rel.add(logq, label, depth, tried)
    conf, lab, cnt = rel.result()
    assert sum(cnt[0]) == 2 and sum(cnt[1]) == 0 and sum(lab[0]) == 1.0
    assert cnt[0][GRID.index(0.9)] == 1 and cnt[0][GRID.index(0.3)] == 1


def _check_tree(tree, total, depth):
    assert tree.size == total
    for b in range(tree.tokens.shape[0]):
        par, dep = tree.parents[b], tree.depth[b]
        assert par[0] == -1 and bool((par[1:] >= 0).all()) and bool((par[1:] < torch.arange(1, total)).all())
        assert torch.equal(dep[1:], dep[par[1:]] + 1) and int(dep.max()) <= depth
        Tree.from_parents(par)


@pytest.mark.parametrize("map", ["isotonic", "power"])
@pytest.mark.parametrize("total,depth,k", [(10, 4, 3), (26, 6, 4), (40, 5, 8)])
@pytest.mark.parametrize("seed", range(6))
def test_calibrated_dynamic_tree_is_connected_topological_and_within_budget(total, depth, k, seed, map):
    cal = random_calibration(seed, depth=3, map=map)
    d = primed_drafter(seed % 3)
    with torch.inference_mode():
        tree = DynamicPolicy(total, depth, k, calibration=cal).draft(d)
    _check_tree(tree, total, depth)
    # kept nodes' calibrated path scores: a child never above its parent
    for b in range(2):
        par, dep, sc = tree.parents[b], tree.depth[b], tree.scores[b]
        edge = sc[1:] - sc[par[1:]]
        s = torch.zeros(total)
        for i in range(1, total):
            s[i] = s[par[i]] + cal.log_accept(edge[i - 1], int(dep[i]))
        assert bool((s[1:] <= s[par[1:]] + 1e-6).all())


@pytest.mark.parametrize("seed", range(3))
def test_identity_calibration_grows_exactly_the_raw_tree(seed):
    """The identity map ranks exactly as raw draft probabilities (expansion and rerank both use it)."""
    ident = Calibration([[max(g, FLOOR) for g in GRID]])
    d = primed_drafter(seed)
    with torch.inference_mode():
        raw = DynamicPolicy(16, 5, 3).draft(d)
        same = DynamicPolicy(16, 5, 3, calibration=ident).draft(d)
    assert torch.equal(raw.parents, same.parents) and torch.equal(raw.tokens, same.tokens)
    assert torch.equal(raw.scores, same.scores)  # Tree.scores stay the draft's cumulative log-probs


@pytest.mark.slow
def test_bundled_head_calibrated_and_auto_are_lossless_greedy_fp32():
    """The bundled model and head in fp32: the shipped calibration (auto) and the auto budget emit vanilla's tokens."""
    from treedec.decoding.speculative import SpeculativeDecoder
    from treedec.decoding.vanilla import VanillaDecoder
    from treedec.heads import load_head
    from treedec.models import load_model
    from treedec.models.tokenizer import load_tokenizer

    target = load_model("tiny-code", dtype="float32").eval()
    draft = load_head("tiny-code-eagle", target=target, dtype=torch.float32).eval()
    tok = load_tokenizer("tiny-code")
    prompts = [tok.encode("import os\n\n\ndef walk(root):\n    for name in os.listdir(root):\n"),
               tok.encode("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(")]
    ref = VanillaDecoder(target, eos_ids=[]).generate(prompts, 64).tokens
    raw = SpeculativeDecoder(target, draft, DynamicPolicy(26, 6, 4), eos_ids=[]).generate(prompts, 64)
    cal = SpeculativeDecoder(target, draft, DynamicPolicy(26, 6, 4, calibration="auto", draft_path="tiny-code-eagle"),
                             eos_ids=[]).generate(prompts, 64)
    assert raw.tokens == ref == cal.tokens
    assert cal.stats.tau > raw.stats.tau  # the shipped calibration sends the budget deeper, where this head is right
    for pol in (DynamicPolicy(26, 6, 4, calibration="auto", draft_path="tiny-code-eagle"),
                AutoPolicy(6, 4, calibration="auto", draft_path="tiny-code-eagle")):
        assert pol.calibration is not None
        assert SpeculativeDecoder(target, draft, pol, eos_ids=[]).generate(prompts, 64).tokens == ref
