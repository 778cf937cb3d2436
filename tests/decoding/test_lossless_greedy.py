"""Invariant 1: greedy speculative output is token for token the vanilla greedy output.

The one lossless matrix: policy (fixed, dynamic, auto, learned, calibrated, prompt lookup, per-row padding) x head kind
(EAGLE, EAGLE-3, one-pass parallel and DFlash) x attention kernel (eager, sdpa, triton) x batch (one row, a ragged batch of three)
x dtype. In fp32 speculative output is vanilla's token for token. In bfloat16 a tree pass and a one-token pass round
differently, so the two may part at a numerical tie (the target's top two logits within 2 rounding units, the bench's
``tie_ulps``) and nowhere else: the first difference must be such a tie. A one-pass head drafts under its own policies
(:data:`ONE_PASS_POLICIES`: chains and best-first trees from per-depth marginals); the node-by-node policies refuse it
(tests/tree/test_best_first.py). Tests elsewhere that decode greedily check something beyond equality (tau bounds,
host reads, compaction, compile, int8 heads, lookup copies)."""
import functools
import tempfile

import pytest
import torch

from tests.helpers import (
    OraclePolicy,
    dflash_pair,
    eagle3_pair,
    greedy_reference,
    make_pair,
    needs_triton,
    parallel_pair,
    random_calibration,
    with_cheap_drafts,
)
from treedec.bench.harness import logit_gap
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.tree.policies import AutoPolicy, ChainPolicy, DynamicPolicy, LearnedPolicy, StaticPolicy
from treedec.tree.policies.best_first import BestFirstPolicy
from treedec.tree.policies.learned import save_learned
from treedec.tree.policies.lookup import LookupPolicy
from treedec.tree.sequoia import solve


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
    # per-row budgets: a poor row's tree is padded (padding nodes see only themselves and are never accepted)
    "dynamic_shared": lambda: DynamicPolicy(total_tokens=16, depth=4, top_k=3, node_share=0.5),
    # calibrated acceptance (isotonic tables and power maps) ranking the dynamic and auto trees
    "dynamic_calibrated": lambda: DynamicPolicy(20, 5, 4, calibration=random_calibration(0)),
    "dynamic_calibrated_power": lambda: DynamicPolicy(20, 5, 4, calibration=random_calibration(1, map="power")),
    "auto_calibrated": lambda: AutoPolicy(5, 4, 48, calibration=random_calibration(2)),
    "auto_calibrated_power": lambda: AutoPolicy(5, 4, 48, calibration=random_calibration(0, map="power")),
    # prompt lookup: the context's copy beside each inner tree (two mask words beside the 63-node shape)
    "lookup_chain": lambda: LookupPolicy(ChainPolicy(depth=3), tokens=10),
    "lookup_static": lambda: LookupPolicy(StaticPolicy(shape="eagle_mc_sim_7b_63"), tokens=10),
    "lookup_dynamic": lambda: LookupPolicy(DynamicPolicy(total_tokens=12, depth=4, top_k=3), tokens=10),
    "lookup_dynamic_shared": lambda: LookupPolicy(DynamicPolicy(total_tokens=10, depth=4, top_k=3, node_share=0.6),
                                                  tokens=10),
}
# the policies added to the matrix from their own files' lossless tests: each on fewer seeds (one row) and one
# ragged case per head, so that they cost about what those tests did
FOLDED = ("dynamic_shared", "dynamic_calibrated", "dynamic_calibrated_power", "auto_calibrated",
          "auto_calibrated_power", "lookup_chain", "lookup_static", "lookup_dynamic", "lookup_dynamic_shared")

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
    "dflash": (range(3), 150, 30, lambda seed, **kw: dflash_pair(seed, K=5, k=0 if seed == 2 else 40, sharpen=4, **kw),
               ONE_PASS_POLICIES),
}
ONE_PASS = ("parallel", "dflash")
ONE_ROW = [(policy, head, seed) for head, (seeds, *_, pols) in HEADS.items() if head not in ONE_PASS
           for policy in pols for seed in (seeds if policy not in FOLDED else seeds[:2] if head == "eagle" else [2])]
# a one-pass head's cases, each seed only where it adds coverage (seed 2: the whole vocabulary as draft vocabulary)
ONE_ROW += [(policy, head, seed) for head in ONE_PASS for policy, seeds in [
    ("chain", range(3)), ("chain_block", [1]), ("best_first", range(3)), ("best_first_block", [0, 2]),
    ("best_first_flat", [1]), ("best_first_vocab", [0, 2]), ("lookup_chain", [1, 2]),
    ("auto", range(3)), ("best_first_whole_vocab", [2])] for seed in seeds]
# T - 1 = 64: every token of the whole vocabulary at depth 1, and a tree of T > 64 nodes (two mask words)
ONE_PASS_POLICIES["best_first_whole_vocab"] = lambda: BestFirstPolicy(total_tokens=65, depth=2)


# bfloat16 (target and head), one seed: every policy kind with an EAGLE head, the tree kinds with the others
BF16 = ([(policy, "eagle", 0) for policy in POLICIES if policy not in FOLDED or policy in ("dynamic_shared",
                                                                                           "lookup_dynamic")]
        + [(policy, "eagle3", 0) for policy in ("chain", "dynamic", "learned")]
        + [(policy, head, 0) for head in ONE_PASS for policy in ("chain", "best_first", "auto")])
DTYPES = [(*case, torch.float32) for case in ONE_ROW] + [(*case, torch.bfloat16) for case in BF16]


@pytest.mark.parametrize("policy, head, seed, dtype", DTYPES,
                         ids=[f"{p}-{h}-{s}-{str(d)[6:]}" for p, h, s, d in DTYPES])
def test_random_draft_matches_vanilla(policy, head, seed, dtype):
    _, n, max_len, pair, pols = HEADS[head]
    target, draft = pair(seed)
    target, draft = target.to(dtype), draft.to(dtype)
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 64, (int(torch.randint(1, max_len, (1,), generator=g)),), generator=g).tolist()
    ref = greedy_reference(target, prompt, n)
    out = SpeculativeDecoder(target, draft, pols[policy]()).generate(prompt, n).tokens[0]
    if dtype == torch.float32:
        assert out == ref
        return
    assert len(out) == len(ref)
    part = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
    if part is not None:  # a bf16 rounding tie, never a real difference
        gap, ulp = logit_gap(target, prompt + ref[:part])
        assert gap <= 2 * ulp, (part, gap, ulp)


RAGGED = [("eagle", seed, backend) for seed in range(2) for backend in ("eager", "sdpa")] + [("eagle3", 0, "sdpa")]
RAGGED = [(policy, *case) for case in RAGGED for policy in POLICIES
          if policy not in FOLDED or case in [("eagle", 0, "sdpa"), ("eagle3", 0, "sdpa")]]
# a one-pass head's mask positions over ragged rows (each row's own prefix), through both head attention paths
RAGGED += [(policy, head, seed, backend) for head in ONE_PASS for policy, seed, backend in
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
    if policy.startswith("auto"):  # (its own choice on this machine may be plain steps: long paths are the point here)
        with_cheap_drafts(inner)
    oracle = OraclePolicy(inner, refs, p_hit=0.85, seed=seed)
    pads = []

    def no_padding_accepted(step):
        """The oracle plants the right token on padding nodes too: a padding node ever accepted would show here."""
        if step.tree is None or step.tree.pad is None:
            return
        on = torch.zeros_like(step.tree.pad)
        for b in range(on.shape[0]):
            on[b, step.path[b, : step.n_accept[b]]] = True
        pads.append(int(step.tree.pad.sum()))
        assert not (on & step.tree.pad).any()

    out = SpeculativeDecoder(target, draft, oracle).generate(prompts, 300, stream=oracle.stream,
                                                             hook=no_padding_accepted)
    assert out.tokens == refs  # a ragged batch of three prompts
    assert out.stats.tau > 1.8  # long paths really were accepted and committed
    if policy == "dynamic_shared":
        assert sum(pads) > 0  # per-row budgets padded the poor rows' trees
    # fixed shapes (and best-first trees, whose rank-0 path is always drafted) reach depth >= 3; a dynamic tree of an
    # untrained draft keeps mostly shallow nodes
    deep = policy.removeprefix("lookup_").startswith(("chain", "static", "best_first"))  # (a lookup's: its inner tree's)
    assert max(out.stats.accepted) >= (3 if deep else 2)


@needs_triton
@pytest.mark.parametrize("head, policy", [("eagle", "chain"), ("eagle", "dynamic"), ("eagle", "auto"),
                                          ("eagle3", "dynamic"),
                                          pytest.param("parallel", "best_first", marks=pytest.mark.slow),  # ~5 s
                                          pytest.param("dflash", "best_first", marks=pytest.mark.slow)])
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
