"""Invariant 1: greedy speculative output is token for token the vanilla greedy output.

The one lossless matrix (fp32; the project claims losslessness for fp32 only): policy x head kind (EAGLE, EAGLE-3,
one-pass parallel) x attention kernel (eager, sdpa, triton) x batch (one row, a ragged batch of three). A one-pass head
drafts under its own policies (:data:`ONE_PASS_POLICIES`: chains and best-first trees from per-depth marginals); the
node-by-node policies refuse it (tests/tree/test_best_first.py). Tests elsewhere that decode
greedily check something beyond equality (tau bounds, host reads, compaction, compile, int8 heads, lookup copies)."""
import functools
import tempfile

import pytest
import torch

from treedec.decoding.speculative import SpeculativeDecoder
from treedec.tree.policies import AutoPolicy, ChainPolicy, DynamicPolicy, LearnedPolicy, StaticPolicy
from treedec.tree.policies.best_first import BestFirstPolicy
from treedec.tree.policies.learned import save_learned
from treedec.tree.policies.lookup import LookupPolicy
from treedec.tree.sequoia import solve

from tests.helpers import (OraclePolicy, eagle3_pair, greedy_reference, make_pair, needs_triton, parallel_pair,
                           with_cheap_drafts)


@functools.lru_cache(1)
def learned_file() -> str:
    table = solve([0.6, 0.25, 0.1], 16, 5)
    trees = {n: table.choices(n, 5) for n in range(2, 17)}
    return str(save_learned(f"{tempfile.mkdtemp(prefix='treedec-test-')}/t.yaml", trees[12],
                            {"name": "t12", "budget": 12}, trees))


POLICIES = {
    "chain": lambda: ChainPolicy(depth=4),
    "static_eagle": lambda: StaticPolicy(shape="eagle_mc_sim_7b_63"),
    "static_balanced": lambda: StaticPolicy(shape="balanced_2x3"),
    "dynamic": lambda: DynamicPolicy(total_tokens=20, depth=5, top_k=4),
    "dynamic_wide": lambda: DynamicPolicy(total_tokens=70, depth=3, top_k=6),  # T > 64: two mask words
    "dynamic_deep": lambda: DynamicPolicy(total_tokens=8, depth=6, top_k=4),  # draft reads more nodes than T
    "auto": lambda: AutoPolicy(max_depth=5, top_k=3, max_total_tokens=24),  # sized per step: T and depth vary
    "learned": lambda: LearnedPolicy(learned_file()),  # a calibrated Sequoia tree of 12 nodes
}

# A one-pass (parallel, block_size 5) head's policies: every tree is built from one head pass of per-depth marginals.
ONE_PASS_POLICIES = {
    "chain": lambda: ChainPolicy(depth=4),
    "chain_block": lambda: ChainPolicy(depth=5),  # depth = block_size: every mask position drafts
    "best_first": lambda: BestFirstPolicy(total_tokens=16, depth=4),
    "best_first_block": lambda: BestFirstPolicy(total_tokens=10, depth=5),  # depth = block_size, fewer nodes than k*D
    "best_first_flat": lambda: BestFirstPolicy(total_tokens=6, depth=1),  # no mask position: the root's top 5
    "best_first_vocab": lambda: BestFirstPolicy(total_tokens=41, depth=3),  # k = T - 1 = the 40-token draft vocabulary
    "lookup_chain": lambda: LookupPolicy(ChainPolicy(depth=4)),  # a copied chain beside a one-pass chain
    "auto": lambda: AutoPolicy(max_depth=5, top_k=3, max_total_tokens=24),  # chains and best-first trees per step
}

# head kind -> (seeds, new tokens, max prompt length, the pair, its policies): EAGLE-3 (and parallel) heads over a
# random 40-token draft vocabulary, and (seed 2) over the whole vocabulary; parallel heads sharpened, so that
# best-first trees are 2 to 4 deep (a random head's are all depth 1)
HEADS = {
    "eagle": (range(4), 200, 40, lambda seed, **kw: make_pair(seed, **kw), POLICIES),
    "eagle3": (range(3), 60, 30, lambda seed, **kw: eagle3_pair(seed, k=0 if seed == 2 else 40, **kw), POLICIES),
    "parallel": (range(3), 150, 30, lambda seed, **kw: parallel_pair(seed, K=5, k=0 if seed == 2 else 40, sharpen=4,
                                                                       **kw), ONE_PASS_POLICIES),
}
ONE_ROW = [(policy, head, seed) for head, (seeds, *_, pols) in HEADS.items() if head != "parallel"
           for policy in pols for seed in seeds]
# a one-pass head's cases, each seed only where it adds coverage (seed 2: the whole vocabulary as draft vocabulary)
ONE_ROW += [(policy, "parallel", seed) for policy, seeds in [
    ("chain", range(3)), ("chain_block", [1]), ("best_first", range(3)), ("best_first_block", [0, 2]),
    ("best_first_flat", [1]), ("best_first_vocab", [0, 2]), ("lookup_chain", [1, 2]),
    ("auto", range(3)), ("best_first_whole_vocab", [2])] for seed in seeds]
# T - 1 = 64: every token of the whole vocabulary at depth 1, and a tree of T > 64 nodes (two mask words)
ONE_PASS_POLICIES["best_first_whole_vocab"] = lambda: BestFirstPolicy(total_tokens=65, depth=2)


@pytest.mark.parametrize("policy, head, seed", ONE_ROW, ids=[f"{p}-{h}-{s}" for p, h, s in ONE_ROW])
def test_random_draft_matches_vanilla(policy, head, seed):
    _, n, max_len, pair, pols = HEADS[head]
    target, draft = pair(seed)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 64, (int(torch.randint(1, max_len, (1,), generator=g)),), generator=g).tolist()
    ref = greedy_reference(target, prompt, n)
    out = SpeculativeDecoder(target, draft, pols[policy]()).generate(prompt, n)
    assert out.tokens[0] == ref


RAGGED = [("eagle", seed, backend) for seed in range(2) for backend in ("eager", "sdpa")] + [("eagle3", 0, "sdpa")]
RAGGED = [(policy, *case) for case in RAGGED for policy in POLICIES]
# a one-pass head's mask positions over ragged rows (each row's own prefix), through both head attention paths
RAGGED += [(policy, "parallel", seed, backend) for policy, seed, backend in
           [("chain_block", 0, "eager"), ("best_first", 0, "sdpa"), ("lookup_chain", 0, "sdpa"), ("auto", 0, "sdpa")]]
RAGGED += [pytest.param(policy, "parallel", seed, backend, marks=pytest.mark.slow) for policy, seed, backend in
           [("best_first_block", 1, "eager"), ("best_first_vocab", 1, "sdpa")]]  # ~5 s each


@pytest.mark.parametrize("policy, head, seed, backend", RAGGED,
                         ids=["-".join(map(str, getattr(c, "values", c))) for c in RAGGED])
def test_oracle_draft_matches_vanilla_with_long_accepts(policy, head, seed, backend):
    target, draft = HEADS[head][3](seed + 10, backend=backend)
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed * 7 + n)).tolist() for n in (3, 17, 50)]
    refs = [greedy_reference(target, p, 300) for p in prompts]
    inner = HEADS[head][-1][policy]()
    if policy == "auto":  # (its own choice on this machine may be plain steps: long paths are the point here)
        with_cheap_drafts(inner)
    oracle = OraclePolicy(inner, refs, p_hit=0.85, seed=seed)
    out = SpeculativeDecoder(target, draft, oracle).generate(prompts, 300, stream=oracle.stream)
    assert out.tokens == refs  # a ragged batch of three prompts
    assert out.stats.tau > 1.8  # long paths really were accepted and committed
    # fixed shapes (and best-first trees, whose rank-0 path is always drafted) reach depth >= 3; a dynamic tree of an
    # untrained draft keeps mostly shallow nodes
    assert max(out.stats.accepted) >= (3 if policy.startswith(("chain", "static", "best_first", "lookup")) else 2)


@needs_triton
@pytest.mark.parametrize("head, policy", [("eagle", "chain"), ("eagle", "dynamic"), ("eagle", "auto"),
                                          ("eagle3", "dynamic"),
                                          pytest.param("parallel", "best_first", marks=pytest.mark.slow)])  # ~5 s
def test_triton_backend_matches_vanilla(head, policy):
    target, draft = HEADS[head][3](3, hidden=32, heads=2, kv_heads=1, backend="triton")
    prompt = list(range(5, 14))
    ref = greedy_reference(target, prompt, 24)
    oracle = OraclePolicy(HEADS[head][-1][policy](), [ref], p_hit=0.8)
    out = SpeculativeDecoder(target, draft, oracle).generate(prompt, 24, stream=oracle.stream)
    assert out.tokens[0] == ref


def test_eos_and_max_new_tokens_are_exact():
    target, draft = make_pair(5)
    prompt = [1, 2, 3]
    ref = greedy_reference(target, prompt, 120)
    for n in (1, 2, 7, 33):
        oracle = OraclePolicy(ChainPolicy(6), [ref])
        out = SpeculativeDecoder(target, draft, oracle).generate(prompt, n, stream=oracle.stream)
        assert out.tokens[0] == ref[:n]
        assert out.stats.new_tokens == n
    eos = ref[40]
    stop = ref.index(eos) + 1
    oracle = OraclePolicy(StaticPolicy(shape="eagle_mc_sim_7b_63"), [ref])
    out = SpeculativeDecoder(target, draft, oracle, eos_ids=[eos]).generate(prompt, 120, stream=oracle.stream)
    assert out.tokens[0] == ref[:stop]


def test_stream_sees_every_token_once():
    target, draft = make_pair(6)
    seen = []
    out = SpeculativeDecoder(target, draft, DynamicPolicy(12, 3, 3)).generate([4, 5], 50, stream=lambda b, t: seen.extend(t))
    assert seen == out.tokens[0] and len(seen) == 50


def test_context_overflow_is_a_clear_error():
    target, draft = make_pair(0, ctx=64)
    with pytest.raises(ValueError, match="context"):
        SpeculativeDecoder(target, draft, ChainPolicy(4)).generate(list(range(50)), 20)
