"""tree=auto: the rule, its estimates (the defects each test pins are named), the step-cost table and its cache."""
import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from treedec.tree.policies import AutoPolicy
from treedec.tree.policies.auto.cost import DECAY, STALE, StepCost
from treedec.tree.policies.auto.policy import MAX_GAP
from treedec.tree.policies.auto.profile import profile_key


class FakeCost:
    """Seconds per shape from a formula of (rows, width, depth, T); records what the steps measured."""

    def __init__(self, policy, fn):
        self.shapes, self.fn, self.seen = policy.shapes, fn, []

    def seconds(self, rows):
        return np.array([self.fn(rows, k, d, t) for k, d, t in self.shapes], dtype=float)

    def observe(self, rows, shape, seconds):
        self.seen.append((rows, shape, seconds))


def policy(cost_fn=lambda rows, k, d, t: 1.0 + 0.1 * d + 0.01 * t, **kw) -> AutoPolicy:
    pol = AutoPolicy(calibration=None, **kw)
    pol.cost = FakeCost(pol, cost_fn)
    return pol


def play(pol, i, promised, accepted, rows=1, along=True):
    """One step of shape ``i`` whose scores promised ``promised`` (a chain: reach per depth [D]; a pool:
    [depth limit, T - 1, (other nodes' scores, holds the path), depth]) and whose rows accepted ``accepted`` drafts each, along the
    top-1 path (``along``) or off it."""
    pol._step = (rows, i)
    if promised is not None and np.ndim(promised) == 1:  # a chain: all on its top-1 path
        promised = np.stack([np.zeros_like(promised), np.ones_like(promised)])
    D = pol.max_depth
    path = torch.arange(100, 100 + D).expand(len(accepted), D)
    tokens = [list(range(100, 100 + a)) if along else [7] * a for a in accepted]
    pol._pending = None if promised is None else (np.asarray(promised, dtype=np.float32), path)
    pol.observe(SimpleNamespace(seconds=None, n_accept=[a + 1 for a in accepted], active=[True] * len(accepted),
                                tokens=[t + [0] for t in tokens]))


def index(pol, k, d, t):
    return pol.shapes.index((k, d, t))


def chain_promise(c, D):
    return c ** np.arange(1, D + 1)


def pool_promise(pol, D, per_depth, p=0.9):
    """A pool drafted to depth D whose best nodes, best first, sit at the depths ``per_depth`` lists (each ``p``);
    a depth's first node is on the top-1 path when every shallower depth has one before it."""
    n = pol.max_size - 1
    out = np.zeros((D - 1, n, 2, D))
    for lim in range(2, D + 1):
        order = [d for d in per_depth if d <= lim][:n]
        for j in range(n):
            path = 0
            for d in order[: j + 1]:
                on = d == path + 1
                path += on
                out[lim - 2, j, int(on), d - 1] += 1.0 if on else p
    return out


def test_a_tree_is_credited_with_its_own_nodes_not_its_chains_reach():
    """Defect 1: a tree whose nodes are all at depth 1 reaches depth 1 only, however far its chain goes."""
    pol = policy(max_depth=4, top_k=4, max_total_tokens=8)
    play(pol, index(pol, 1, 4, 5), chain_promise(0.95, 4), [4])  # chains go deep
    flat = pool_promise(pol, 4, [1, 1, 1, 1, 1, 1, 1], p=0.13)  # all at depth 1 (each row may accept one of them)
    play(pol, index(pol, 4, 4, 8), flat, [1])
    e = pol.expected()
    assert e[index(pol, 4, 3, 8)] <= 1.0 + 1e-6  # depth 1 at most, not a 3-deep chain's 2.7
    assert e[index(pol, 1, 3, 4)] > 2.5


def test_the_rule_picks_the_most_tokens_per_second():
    pol = policy(lambda rows, k, d, t: 1.0 + 0.1 * d + 0.001 * t * rows, max_depth=6, top_k=4, max_total_tokens=32)
    play(pol, index(pol, 1, 6, 7), chain_promise(0.9, 6), [6])
    play(pol, index(pol, 4, 6, 32), pool_promise(pol, 6, [1, 2, 3, 4, 5, 6] * 6, p=0.15), [6])
    pol._gap = [10 ** 9] * len(pol.groups)  # no probe due
    value = (1 + pol.expected()) / pol.cost.seconds(1)
    assert pol.choose(1) == int(np.nanargmax(value))
    # a verify that grows with the tokens: at 64 rows the tree costs far more, a chain wins
    assert pol.shapes[pol.choose(64)][0] == 1


def test_the_online_correction_converges_to_what_the_target_accepts():
    """A calibration that promises twice what the target accepts is corrected within a few dozen steps."""
    pol = policy(max_depth=4, top_k=1)
    i = index(pol, 1, 4, 5)
    rng = np.random.default_rng(0)
    promise = chain_promise(0.9, 4)
    for _ in range(60):  # the truth: each depth is reached with half the promised chance
        u = rng.random()
        play(pol, i, promise, [int((u < promise / 2).sum())])
    e, truth = pol.expected()[i], (promise / 2).sum()
    assert abs(e - truth) < 0.35 * truth, (e, truth)


@pytest.mark.parametrize("kind", ["chains accept nothing", "plain steps win"])
def test_no_shape_is_locked_out(kind):
    """Defect 7: after chains that accept nothing, plain steps win, yet chains are played again, ever less often
    while they keep losing, but at least every MAX_GAP steps."""
    pol = policy(lambda rows, k, d, t: 1.0 + 0.5 * d, max_depth=4, top_k=1)
    played = []
    for _ in range(600):
        i = pol.choose(1)
        played.append(i)
        k, d, t = pol.shapes[i]
        play(pol, i, None if d == 0 else chain_promise(0.5, d), [0])
    chains = [s for s, i in enumerate(played) if pol.shapes[i][1] > 0]
    assert len(chains) >= 600 // MAX_GAP and max(np.diff(chains)) <= MAX_GAP
    assert len(chains) < 30  # it mostly decodes plainly


def test_a_tree_the_target_starts_accepting_wins_back():
    pol = policy(lambda rows, k, d, t: 1.0 + 0.05 * d + 0.005 * t, max_depth=4, top_k=4, max_total_tokens=16)
    good = False
    for step in range(400):
        i = pol.choose(1)
        k, d, t = pol.shapes[i]
        if d == 0:
            play(pol, i, None, [0])
        elif k == 1:
            play(pol, i, chain_promise(0.3, d), [0])
        else:
            play(pol, i, pool_promise(pol, d, list(range(1, d + 1)) * 8, p=0.12), [d if step > 200 else 0])
        good |= step > 200 and k > 1 and step < 200 + MAX_GAP + 40 and pol.shapes[pol.choose(1)][0] > 1
    assert good


# --------------------------------------------------------------------------------------------- the cost table
SHAPES = [(1, 0, 1), (1, 1, 2), (1, 4, 5), (4, 3, 16)]


def table(scale=1.0):
    return {"verify": {1: 1.0 * scale, 2: 1.1 * scale, 16: 2.0 * scale},
            "draft": {1: {1: 0.1 * scale, 4: 0.4 * scale}, 4: {1: 0.2 * scale, 3: 0.6 * scale}}}


def test_seconds_are_table_seconds_and_never_negative():
    """Defect 2: a table steps beat 3x, or a disturbed point, never predicts zero or negative seconds."""
    t = table()
    t["verify"][2] = 5.0  # a disturbed run: above the T=16 point (lowered to it)
    cost = StepCost(SHAPES, {"device": "x"}, lambda rows, have: t)
    cost.prepare(1)
    s = cost.seconds(1)
    assert s[0] == 1.0 and s[1] == pytest.approx(2.0 + 0.1) and s[3] == pytest.approx(2.0 + 0.6)
    for _ in range(200):
        cost.observe(1, 2, 0.01)
    assert (cost.seconds(1) > 0).all()


def test_the_table_is_kept_and_each_run_measures_only_what_it_lacks(tmp_path):
    """Defect 8: runs that differ only in their largest tree or depth share one file and measure only the points it
    lacks; a smaller run measures nothing."""
    calls = []

    def measure_for(shapes):
        def measure(rows, have):
            calls.append((rows, sorted(have.get("verify", {}))))
            full = table()
            return {"verify": {t: s for t, s in full["verify"].items() if t <= max(x[2] for x in shapes) or t <= 2},
                    "draft": {k: v for k, v in full["draft"].items() if k in {x[0] for x in shapes}}}
        return measure

    small = SHAPES[:3]
    StepCost(small, {"device": "x"}, measure_for(small), tmp_path).prepare(1)
    StepCost(SHAPES, {"device": "x"}, measure_for(SHAPES), tmp_path).prepare(1)
    StepCost(SHAPES[:2], {"device": "x"}, measure_for(SHAPES), tmp_path).prepare(1)
    assert [c[0] for c in calls] == [1, 1] and calls[1][1] == [1, 2]  # the second was handed the first's points
    assert len(list(tmp_path.iterdir())) == 1
    calls.clear()
    StepCost(SHAPES, {"device": "x"}, measure_for(SHAPES), tmp_path).prepare(4)  # 4 rows: measured at 4 (1 is kept)
    assert [c[0] for c in calls] == [4]


@pytest.mark.parametrize("bad", ["not json", {"rows": {"1": {"verify": {}, "draft": {"1": {"1": 0.1}}}}},
                                 {"rows": {"1": {"verify": {"1": 1.0}, "draft": {}}}},
                                 {"rows": {"1": {"verify": {"1": "nan"}, "draft": {"1": {"1": 0.1}}}}},
                                 {"rows": {"1": {"verify": {"1": -1.0}, "draft": {"1": {"1": 0.1}}}}},
                                 {"rows": {"1": {"verify": {"1": 0.0}, "draft": {"1": {"1": 0.1}}}}},
                                 {"rows": {"1": {"verify": {"1": 1e999}, "draft": {"1": {"1": 0.1}}}}}],
                         ids=["corrupt", "empty verify", "empty draft", "nan", "negative", "zero", "inf"])
def test_a_bad_cache_is_measured_again_with_a_warning_naming_it(bad, tmp_path, caplog):
    """Defect 6: an empty, corrupt, non-finite or non-positive table never fails a run nor is used."""
    first = StepCost(SHAPES, {"device": "x"}, lambda rows, have: table(), tmp_path)
    first.path.parent.mkdir(parents=True, exist_ok=True)
    first.path.write_text(bad if isinstance(bad, str) else json.dumps(bad).replace('"nan"', "NaN"))
    calls = []
    with caplog.at_level(logging.WARNING):
        cost = StepCost(SHAPES, {"device": "x"}, lambda rows, have: calls.append(rows) or table(), tmp_path)
        cost.prepare(1)
    assert calls == [1] and str(cost.path) in caplog.text
    assert np.isfinite(cost.seconds(1)).all() and (cost.seconds(1) > 0).all()


def test_steps_that_keep_disagreeing_with_the_table_remeasure_it(tmp_path, caplog):
    """Defect 3 (second half): a table measured on a loaded machine is not trusted forever."""
    calls = []
    cost = StepCost(SHAPES, {"device": "x"}, lambda rows, have: calls.append(rows) or table(3.0), tmp_path)
    cost.prepare(1)
    for _ in range(round(2 / DECAY)):  # the steps take a third of the table's time
        cost.observe(1, 0, 1.0)
    assert cost.ratio[1, False] < 1 / STALE and cost.stale == 1
    with caplog.at_level(logging.WARNING):
        cost.prepare(1)
    assert calls == [1, 1] and str(cost.path) in caplog.text and cost.stale is None
    assert (1, False) not in cost.ratio  # the new table starts unscaled: no second re-measurement from the old scale
    for _ in range(round(4 / DECAY)):  # still a third: the steps' own, which the scale holds; never measured again
        cost.observe(1, 0, 1.0)
    cost.prepare(1)
    assert calls == [1, 1] and cost.ratio[1, False] < 1 / STALE


def test_the_profile_key_names_compile_and_quantisation():
    """Defect 3: an int8 or compiled target is another machine as far as step costs go."""
    from tests.helpers import make_pair
    from treedec.heads.quantized import quantize_linears

    target, draft = make_pair(1)
    head = draft.bind(target)
    plain = profile_key(target, head, False)
    assert profile_key(target, head, True) != plain
    quantize_linears(target)
    assert profile_key(target, head, False)["target"] != plain["target"]


def test_a_depth_no_step_reaches_follows_the_deepest_continuation():
    """Chains played 4 deep, accepted twice what the scores promise: the top-1 path's reach is counted (near the
    truth, not the scores), and a deeper chain (drafted long ago) continues at the deepest counted continuation, not
    at its raw scores (else a winning chain could never be found too shallow)."""
    pol = policy(max_depth=6, top_k=1)
    promise = chain_promise(0.45, 6)
    pol.reach[index(pol, 1, 6, 7)], pol._known[index(pol, 1, 6, 7)] = [np.zeros(6), np.ones(6)], True
    rng = np.random.default_rng(0)
    for _ in range(200):
        u = rng.random(16)
        play(pol, index(pol, 1, 4, 5), promise[:4], list((u[:, None] < 2 * promise[:4]).sum(1)), rows=16)
    path, _ = pol.corrections()
    assert np.allclose(path[:4], 2 * promise[:4], rtol=0.35)
    assert path[4] / path[3] == pytest.approx(path[3] / path[2]) == pytest.approx(path[5] / path[4])
    e = pol.expected()
    assert e[index(pol, 1, 6, 7)] - e[index(pol, 1, 4, 5)] == pytest.approx(path[4] + path[5])


def test_plain_and_drafted_steps_are_scaled_apart():
    """A drafted step's acceptance, commit and catch-up are in no profiled pass: drafted steps that take twice their
    table make every drafted shape dearer, not the plain step (so sampling at a high temperature falls back to it)."""
    cost = StepCost(SHAPES, {"device": "x"}, lambda rows, have: table())
    cost.prepare(1)
    before = cost.seconds(1)
    for _ in range(round(4 / DECAY)):
        cost.observe(1, 0, before[0])  # plain steps as the table says
        cost.observe(1, 2, 2 * before[2])  # a chain's twice
    after = cost.seconds(1)
    assert after[0] == pytest.approx(before[0], rel=0.01)
    assert after[1:] == pytest.approx(2 * before[1:], rel=0.05)
