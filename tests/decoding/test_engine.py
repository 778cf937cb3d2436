"""The decoding engine's contracts: host reads per step, τ, the context end, input checks, hooks."""
import math

import pytest
import torch

from tests.helpers import OraclePolicy, greedy_reference, host_reads_per_step, make_pair
from treedec.decoding import vanilla
from treedec.decoding.loop import DecodeStats
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.profiling import count_ops
from treedec.sampling import SamplingParams
from treedec.tree import TreeError
from treedec.tree.policies import AutoPolicy, ChainPolicy, DynamicPolicy, StaticPolicy
from treedec.tree.policies.auto.cost import StepCost

POLICIES = {
    "chain": lambda: ChainPolicy(4),
    "static": lambda: StaticPolicy(shape="eagle_mc_sim_7b_63"),
    "dynamic": lambda: DynamicPolicy(16, 5, 4),
}


@pytest.mark.parametrize("layers", [2, 12])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, top_p=0.95)], ids=["greedy", "sample"])
def test_at_most_four_host_reads_per_step_whatever_the_depth_of_the_model(layers, policy, params):
    target, draft = make_pair(1, layers=layers, hidden=32, heads=2, kv_heads=1)
    dec = SpeculativeDecoder(target, draft, POLICIES[policy](), params)
    g = torch.Generator().manual_seed(0)
    with count_ops() as short:
        dec.generate([[1, 2, 3], [4, 5]], 4, generator=g)
    with count_ops() as long:
        res = dec.generate([[1, 2, 3], [4, 5]], 40, generator=g)
    steps = res.stats.steps
    assert steps > 10
    # Reads that do not grow with the number of steps (prompt checks, prefill, end of run) cancel out.
    per_step = (long.host_reads - short.host_reads) / (steps - 1)
    assert per_step <= 4, long.reads


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.8, top_p=0.95)], ids=["greedy", "sample"])
def test_tree_auto_reads_the_device_once_per_step(params, tmp_path):
    """Its estimates ride the step's one read (host copies started before it, read after it)."""
    target, draft = make_pair(1, layers=12, hidden=32, heads=2, kv_heads=1)
    policy = AutoPolicy(5, 4, cost_cache=str(tmp_path))
    dec = SpeculativeDecoder(target, draft, policy, params)
    # drafts nearly free and a flat verify, whatever the machine's load: trees of every size pay even for this
    # random draft, and the shapes chosen (so the rare top-p misses) are the same every run
    profile = {"verify": {1: 1.0, 64: 1.05}, "draft": {k: {1: 0.001, 5: 0.005} for k, _, _ in policy.shapes}}
    policy.cost = StepCost(policy.shapes, {"device": "fixed"}, lambda rows, have: profile, tmp_path)
    policy.cost.observe = lambda *a: None  # (the timed steps would pull the table towards this machine's costs)
    per_step, steps, res, reads = host_reads_per_step(dec, warm=40, n=60)
    assert res.stats.steps > 10 and sum(T > D + 1 for T, D in policy.history) > 10  # trees were played
    assert per_step <= 1 + 1 / steps, reads  # a rare top-p miss may add one


def test_each_step_is_timed_alone_and_the_policys_preparation_apart(tmp_path):
    """A step's seconds run from its draft to its read (no prefill, no admitted prompt's prefill in them), and the
    policy's one-time profile is reported apart, never in tok/s."""
    target, draft = make_pair(1, layers=12, hidden=32, heads=2, kv_heads=1)
    policy = AutoPolicy(4, 2, cost_cache=str(tmp_path))
    seen = []
    res = SpeculativeDecoder(target, draft, policy).serve([[1, 2, 3], [4, 5], [6]], 12, slots=2,
                                                          hook=lambda info: seen.append(info))
    assert res.stats.prepare_time > 0 and policy.cost.tables  # profiled before decoding, on this first run
    assert sum(policy.cost.ratio.values()) > 0 and all(s is not None and s > 0 for s in map(_seconds, seen))
    steps = sum(map(_seconds, seen))
    assert steps <= res.stats.total_time  # the profile is not in total_time
    again = SpeculativeDecoder(target, draft, AutoPolicy(4, 2, cost_cache=str(tmp_path))).generate([[1, 2]], 4)
    assert again.stats.prepare_time < res.stats.prepare_time  # the kept table: nothing measured


def _seconds(info):
    return info.seconds


def test_vanilla_reads_once_per_step():
    target, _ = make_pair(2, layers=12, hidden=32, heads=2, kv_heads=1)
    with count_ops() as c:
        res = vanilla.generate(target, [[1, 2, 3], [7]], 30, eos_ids=[])
    assert c.host_reads <= res.stats.steps + 3


def test_tau_counts_only_emitted_tokens():
    target, draft = make_pair(5)
    prompt = [1, 2, 3]
    ref = greedy_reference(target, prompt, 40)
    oracle = OraclePolicy(ChainPolicy(6), [ref], p_hit=1.0)
    res = SpeculativeDecoder(target, draft, oracle).generate(prompt, 2, stream=oracle.stream)
    # prefill gives token 1; one pass accepts a long chain, but only one more token is emitted
    assert res.tokens[0] == ref[:2] and res.stats.steps == 1 and res.stats.tau == 1.0
    refs = [ref, greedy_reference(target, [9, 9], 40)]
    oracle = OraclePolicy(ChainPolicy(3), refs, p_hit=1.0)
    res = SpeculativeDecoder(target, draft, oracle).generate([prompt, [9, 9]], 8, stream=oracle.stream)
    st = res.stats
    assert res.tokens == [r[:8] for r in refs]
    assert st.step_tokens == 2 * 7  # 8 tokens a row, the first from the prefill
    assert st.tau == pytest.approx(14 / st.row_steps)
    assert st.steps == 2 and st.row_steps == 4  # a pass verifies both rows: 2 passes, 4 row-steps
    assert st.as_dict()["target_forwards"] == 3


def test_stats_merge_adds_runs():
    target, draft = make_pair(6)
    dec = SpeculativeDecoder(target, draft, DynamicPolicy(8, 3, 3))
    a, b = dec.generate([1, 2], 20).stats, dec.generate([3, 4, 5], 30).stats
    m = a.merge(b)
    assert m.new_tokens == 50 and m.steps == a.steps + b.steps
    assert m.tau == pytest.approx((a.step_tokens + b.step_tokens) / (a.row_steps + b.row_steps))
    assert m.accepted == a.accepted + b.accepted and isinstance(m, DecodeStats)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_speculative_accepts_exactly_what_vanilla_accepts_at_the_context_end(policy):
    ctx = 64
    target, draft = make_pair(3, ctx=ctx)
    for plen, n in [(ctx - 1, 1), (ctx - 10, 10), (ctx - 30, 30), (40, ctx - 40)]:
        prompt = [(7 * i) % 64 for i in range(plen)]
        want = vanilla.generate(target, prompt, n, eos_ids=[]).tokens[0]
        got = SpeculativeDecoder(target, draft, POLICIES[policy](), eos_ids=[]).generate(prompt, n).tokens[0]
        assert got == want and len(got) == n
    with pytest.raises(ValueError, match="at most 4"):
        SpeculativeDecoder(target, draft, POLICIES[policy]()).generate(list(range(60)), 5)


def test_hook_sees_every_pass_with_its_verdicts():
    target, draft = make_pair(4)
    ref = greedy_reference(target, [5, 6], 50)
    oracle = OraclePolicy(StaticPolicy(shape="eagle_mc_sim_7b_63"), [ref], p_hit=0.9)
    seen = []
    res = SpeculativeDecoder(target, draft, oracle).generate([5, 6], 50, stream=oracle.stream, hook=seen.append)
    assert len(seen) == res.stats.steps and [s.index for s in seen] == list(range(1, len(seen) + 1))
    assert [t for s in seen for t in s.tokens[0]][: 49] == ref[1:50]
    passes = []
    vanilla.generate(target, [5, 6], 10, hook=passes.append)
    assert [s.index for s in passes] == list(range(1, 10)) and [s.tokens[0][0] for s in passes] == ref[1:10]
    for s in seen:
        tried = s.tried_ranks(0)
        assert len(tried) >= 1 and tried[0][0] == 1
        assert sum(hit >= 0 for _, _, hit in tried) == s.n_accept[0] - 1


@pytest.mark.parametrize("bad,match", [
    (dict(prompts=[[1.0, 2.0]]), "integers"),
    (dict(prompts=torch.tensor([[1.5, 2.0]])), "integers"),
    (dict(max_new_tokens=2.5), "whole number"),
    (dict(max_new_tokens=True), "whole number"),
    (dict(prompts=[[1, 99]]), "outside the vocabulary"),
])
def test_api_inputs_are_checked_before_any_work(bad, match):
    target, draft = make_pair(0)
    args = dict(prompts=[[1, 2]], max_new_tokens=4) | bad
    for dec in (SpeculativeDecoder(target, draft, ChainPolicy(2)), vanilla.VanillaDecoder(target)):
        with pytest.raises(ValueError, match=match):
            dec.generate(args["prompts"], args["max_new_tokens"])


def test_eos_ids_may_be_an_int_and_bad_ones_are_rejected():
    target, draft = make_pair(5)
    ref = greedy_reference(target, [1, 2, 3], 60)
    eos = ref[20]
    stop = ref.index(eos) + 1
    assert SpeculativeDecoder(target, draft, ChainPolicy(3), eos_ids=eos).generate([1, 2, 3], 60).tokens[0] == ref[:stop]
    with pytest.raises(ValueError, match="eos_ids"):
        SpeculativeDecoder(target, draft, ChainPolicy(3), eos_ids=[1.5])


@pytest.mark.parametrize("kw", [dict(temperature=math.nan), dict(temperature=math.inf), dict(top_p=math.nan),
                                dict(top_k=2.5), dict(temperature="hot")])
def test_sampling_params_reject_non_numbers(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_policies_that_need_more_tokens_than_the_vocabulary_fail_up_front():
    target, draft = make_pair(0, vocab=8)
    with pytest.raises(TreeError, match="vocabulary has only 8"):
        SpeculativeDecoder(target, draft, DynamicPolicy(10, 2, 9))
    with pytest.raises(TreeError, match="vocabulary has only 8"):
        SpeculativeDecoder(target, draft, StaticPolicy(choices=[[0], [8]]))


@pytest.mark.parametrize("policy", ["static", "dynamic", "static_sampled"])
def test_a_reduced_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(policy):
    target, draft = make_pair(9)
    allowed = torch.arange(0, 64, 3)  # 22 of the 64 tokens
    draft.restrict_vocab(allowed)
    make = {"static": lambda: StaticPolicy(shape="balanced_2x3"), "dynamic": lambda: DynamicPolicy(12, 3, 3),
            "static_sampled": lambda: StaticPolicy(shape="balanced_2x3", sample_drafts=True)}[policy]
    seen = []
    params = SamplingParams(1.0) if policy == "static_sampled" else SamplingParams()
    dec = SpeculativeDecoder(target, draft, make(), params)
    g = torch.Generator().manual_seed(0)
    out = dec.generate([1, 2, 3], 60, generator=g, hook=lambda s: seen.append(s.tree.tokens[0, 1:].clone()))
    assert bool(torch.isin(torch.cat(seen), allowed).all())
    if policy != "static_sampled":
        assert out.tokens[0] == greedy_reference(target, [1, 2, 3], 60)
    else:
        q = seen and dec.drafter.head.to_target_probs(torch.full((1, 22), 1 / 22))
        assert float(q[0, ~torch.isin(torch.arange(64), allowed)].sum()) == 0.0


def test_draft_vocabulary_is_saved_with_the_head(tmp_path):
    from treedec.heads import load_head

    target, draft = make_pair(9)
    draft.restrict_vocab([5, 1, 7])
    draft.save(tmp_path)
    back = load_head(tmp_path, target=target)
    assert back.vocab_ids.tolist() == [5, 1, 7] and back.logits(torch.zeros(1, 32 * 2)).shape[-1] == 3
    with pytest.raises(ValueError, match="distinct token ids"):
        draft.restrict_vocab([1, 1])
