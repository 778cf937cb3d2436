"""Plain decoding steps inside speculative decoding (issue 17): a tree of the root alone costs what a
vanilla step costs, and the draft head catches up lazily, in one forward, when the next real tree is drafted.

Root-only steps and real trees alternate in seeded random runs (some longer than
``Drafter.MAX_PENDING``, which forces a catch-up mid-run): greedy fp32 stays vanilla's token for
token, sampling draws as vanilla does, the draft cache ends up as eager catch-up leaves it, and a
root-only step dispatches about as many aten ops as a vanilla step, with one host read and no head forward.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import OraclePolicy, eagle3_pair, make_pair
from treedec.decoding import vanilla
from treedec.decoding.drafter import Drafter
from treedec.decoding.speculative import CompactingDecoder, SpeculativeDecoder
from treedec.profiling import count_ops
from treedec.sampling import SamplingParams
from treedec.tree import Tree
from treedec.tree.policies import ChainPolicy, DynamicPolicy, StaticPolicy
from treedec.tree.policies.base import TreePolicy

from .test_lossless_sampling import PROMPT, N, V, per_position, target_law

LONG_RUN = 2 * Drafter.MAX_PENDING + 3  # (fixed here: an eager run patches MAX_PENDING)
INNER = {
    "chain": lambda: ChainPolicy(4),
    "static": lambda: StaticPolicy(shape="balanced_2x3"),
    "dynamic": lambda: DynamicPolicy(12, 4, 3),
}


class MixedPolicy(TreePolicy):
    """The root alone or ``inner``'s tree, per step: runs of plain steps of random lengths (``pattern``: a fixed
    plain/tree sequence, repeated). ``snapshots`` records the drafter's state each time a real tree is drafted."""

    def __init__(self, inner: TreePolicy, seed: int = 0, stay: float = 0.8, pattern: str | None = None):
        self.inner, self.stay, self.pattern = inner, stay, pattern
        for k in ("max_depth", "max_size", "max_inputs", "max_rank"):
            setattr(self, k, getattr(inner, k))
        self.rng = torch.Generator().manual_seed(seed)
        self.plain, self.steps, self.observed, self.snapshots = True, 0, [], []

    def draft(self, drafter, params=None, generator=None) -> Tree:
        if self.pattern is not None:
            self.plain = self.pattern[self.steps % len(self.pattern)] == "p"
        elif self.steps and float(torch.rand((), generator=self.rng)) > self.stay:
            self.plain = not self.plain  # the first step is plain: the prefill's catch-up waits too
        self.steps += 1
        if self.plain:
            return Tree.root_only(drafter.root_tokens)
        feat, logits = drafter.root_feat.clone(), drafter.root_logits.clone()  # (runs a pending catch-up)
        c = drafter.cache
        self.snapshots.append((list(c.host_lengths), c.k.clone(), c.v.clone(), feat, logits))
        return self.inner.draft(drafter, params, generator)

    def observe(self, info) -> None:
        self.observed.append(info)
        self.inner.observe(info)


def long_plain_start(inner: TreePolicy, seed: int) -> MixedPolicy:
    """Odd seeds: random runs; even seeds: 2 * MAX_PENDING + 3 plain steps first (two catch-ups fall due
    before the first tree), then a fixed mix."""
    if seed % 2:
        return MixedPolicy(inner, seed)
    return MixedPolicy(inner, seed, pattern="p" * LONG_RUN + "tptttppptpppppt")


def prompts_for(seed: int, batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(100 + seed)
    lengths = [5] if batch == 1 else [3, 11, 6][:batch]
    return [torch.randint(1, 64, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("seed", range(3))
def test_greedy_fp32_equals_vanilla_when_plain_steps_and_trees_alternate(seed, inner, batch):
    target, draft = make_pair(seed)
    prompts = prompts_for(seed, batch)
    n = 110
    refs = vanilla.generate(target, prompts, n + 40, eos_ids=[]).tokens
    oracle = OraclePolicy(INNER[inner](), refs, p_hit=0.85, seed=seed)  # long accepts: wide ragged catch-ups
    policy = long_plain_start(oracle, seed)
    res = SpeculativeDecoder(target, draft, policy, eos_ids=[]).generate(prompts, n, stream=oracle.stream)
    assert res.tokens == [r[:n] for r in refs]
    sizes = [i.tree.size for i in policy.observed]
    assert 1 in sizes and max(sizes) > 1 and max(i.n_accept[0] for i in policy.observed) > 2


def test_an_eagle3_head_catches_up_lazily_and_stays_lossless():
    target, head = eagle3_pair(4)
    prompts = prompts_for(4, 3)
    refs = vanilla.generate(target, prompts, 100, eos_ids=[]).tokens
    oracle = OraclePolicy(INNER["dynamic"](), refs, p_hit=0.85)
    res = SpeculativeDecoder(target, head, long_plain_start(oracle, 0), eos_ids=[]).generate(
        prompts, 90, stream=oracle.stream)
    assert res.tokens == [r[:90] for r in refs]


NEW = 100


def _decode_with_snapshots(monkeypatch, eager: bool, sampling=SamplingParams(), seed: int = 0):
    if eager:  # every catch-up runs the head at once, as before lazy catch-up
        monkeypatch.setattr(Drafter, "MAX_PENDING", 1)
    target, draft = make_pair(3)
    prompts = prompts_for(1, 3)
    refs = vanilla.generate(target, prompts, 140, eos_ids=[]).tokens
    oracle = OraclePolicy(ChainPolicy(5), refs, p_hit=0.85, seed=1)
    policy = long_plain_start(oracle, seed)
    dec = SpeculativeDecoder(target, draft, policy, sampling, eos_ids=[])
    res = dec.generate(prompts, NEW, generator=torch.Generator().manual_seed(5), stream=oracle.stream)
    monkeypatch.undo()
    return res, dec, policy


@pytest.mark.parametrize("seed", [0, 1])
def test_draft_cache_after_lazy_catch_up_equals_eager_catch_up(monkeypatch, seed):
    (lazy, dl, pl), (eager, de, pe) = (_decode_with_snapshots(monkeypatch, e, seed=seed) for e in (False, True))
    prompts = prompts_for(1, 3)
    assert lazy.tokens == eager.tokens and lazy.stats.as_dict()["accepted_hist"] == eager.stats.as_dict()["accepted_hist"]
    assert len(pl.snapshots) == len(pe.snapshots) > 5
    for (L1, k1, v1, f1, g1), (L2, k2, v2, f2, g2) in zip(pl.snapshots, pe.snapshots):
        assert L1 == L2
        for b, n in enumerate(L1):  # the same K/V at every committed position (fp32: matmuls of other widths)
            torch.testing.assert_close(k1[:, b, :, :n], k2[:, b, :, :n], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(v1[:, b, :, :n], v2[:, b, :, :n], rtol=1e-5, atol=1e-6)
        live = [b for b, n in enumerate(L1) if n < len(prompts[b]) + NEW - 1]  # a finished row's root is unused
        torch.testing.assert_close(f1[live], f2[live], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g1[live], g2[live], rtol=1e-5, atol=1e-5)
    # generate catches up on what is still pending before it returns.
    assert dl.drafter.pending == 0
    assert dl.drafter.cache.host_lengths == de.drafter.cache.host_lengths == dl.drafter.cache.lengths.tolist()


@pytest.mark.parametrize("seed", range(4))
def test_ragged_catch_ups_packed_into_one_forward_equal_one_forward_each(seed):
    """Random chunks (widths 1-5, per-row counts 0..width, padding after them) recorded, then run at once."""
    target, draft = make_pair(seed)
    g = torch.Generator().manual_seed(seed)
    B, H = 3, target.config.hidden_size
    chunks = []
    for i in range(12):
        w = 1 if i % 3 else int(torch.randint(1, 6, (1,), generator=g))  # < MAX_PENDING in all
        n = torch.randint(0 if i else 1, w + 1, (B,), generator=g).tolist()
        chunks.append((torch.randint(0, 64, (B, w), generator=g), torch.randn(B, w, H, generator=g), n))
    lazy, eager = Drafter(draft, B, 200), Drafter(draft, B, 200)
    with torch.inference_mode():
        for tokens, feats, n in chunks:
            root = tokens[:, -1]
            lazy.catch_up(tokens, feats, None, n, root)
            eager.catch_up(tokens, feats, torch.tensor(n), n, root)
            eager.flush()
        assert lazy.pending == sum(max(n) for *_, n in chunks) and lazy.cache.host_lengths == [0] * B
        lazy.flush()
    total = [sum(c) for c in zip(*(n for *_, n in chunks))]
    assert lazy.cache.host_lengths == eager.cache.host_lengths == total == lazy.cache.lengths.tolist()
    for b, L in enumerate(total):
        torch.testing.assert_close(lazy.cache.k[:, b, :, :L], eager.cache.k[:, b, :, :L], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lazy.cache.v[:, b, :, :L], eager.cache.v[:, b, :, :L], rtol=1e-5, atol=1e-6)
    kept = [b for b, n in enumerate(chunks[-1][2]) if n]  # eager reads column 0 of a row that kept nothing
    torch.testing.assert_close(lazy.root_logits[kept], eager.root_logits[kept], rtol=1e-5, atol=1e-5)


def test_lazy_and_eager_catch_up_sample_the_same_tokens(monkeypatch):
    params = SamplingParams(0.9, top_p=0.9)
    lazy, eager = (_decode_with_snapshots(monkeypatch, e, params)[0] for e in (False, True))
    assert lazy.tokens == eager.tokens


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(1.0), SamplingParams(0.8, top_k=20, top_p=0.8)],
                         ids=["greedy", "t1", "topk_topp"])
@pytest.mark.parametrize("batch", [1, 3])
def test_plain_steps_only_decode_exactly_as_vanilla(params, batch):
    """A policy that never drafts is vanilla decoding: the same tokens from the same generator, sampled too."""
    target, draft = make_pair(2)
    prompts = prompts_for(2, batch)
    want = vanilla.generate(target, prompts, 50, params, eos_ids=[], generator=torch.Generator().manual_seed(9))
    policy = MixedPolicy(ChainPolicy(3), pattern="p")
    got = SpeculativeDecoder(target, draft, policy, params, eos_ids=[]).generate(
        prompts, 50, generator=torch.Generator().manual_seed(9))
    assert got.tokens == want.tokens
    st = got.stats
    assert st.tau == 1.0 and st.accepted == {0: st.row_steps} and not st.depth_trials and not st.rank_trials
    assert st.as_dict()["mean_tree_size"] == 1.0
    info = policy.observed[-1]
    assert info.tree.size == 1 and info.path.shape == (batch, 1) and not info.path.any()
    assert info.n_accept == [1] * batch and info.logits.shape == (batch, 1, target.config.vocab_size)
    assert info.tried_ranks(0) == []  # a root has no children to try (calibrate's hook reads this)


@pytest.mark.parametrize("pattern", ["pt", "tp", "pp"])
def test_sampling_with_plain_steps_matches_the_target_distribution(pattern):
    """The first five tokens' law, position by position, when plain steps and trees alternate (as in
    tests/decoding/test_lossless_sampling.py)."""
    target, draft = make_pair(7, vocab=V, hidden=32, heads=2, kv_heads=1, peaked=4.0)
    params = SamplingParams(1.0, top_p=0.8)
    dec = SpeculativeDecoder(target, draft, MixedPolicy(DynamicPolicy(8, 3, 3), pattern=pattern), params)
    out = dec.generate([PROMPT] * N, 5, generator=torch.Generator().manual_seed(0))  # every depth, then the bonus
    results = per_position([tuple(t) for t in out.tokens], target_law(target, params))
    assert all(stat < limit for _, stat, limit in results), results


def _per_step(decode, n1: int, n2: int) -> tuple[float, float, int]:
    """(aten ops, host reads, steps) per step between two run lengths: what does not grow with the run cancels."""
    with count_ops() as short:
        a = decode(n1)
    with count_ops() as long:
        b = decode(n2)
    steps = b.stats.steps - a.stats.steps
    return (long.aten_ops - short.aten_ops) / steps, (long.host_reads - short.host_reads) / steps, steps


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(0.9)], ids=["greedy", "sample"])
def test_a_root_only_step_costs_a_vanilla_step(monkeypatch, batch, params):
    target, draft = make_pair(1, layers=2)
    prompts = [[1, 2, 3]] * batch
    forwards, real = [], type(draft).forward

    def counted(self, *a, **k):  # the head's forwards, by width
        forwards.append(a[0].shape[1])
        return real(self, *a, **k)

    monkeypatch.setattr(type(draft), "forward", counted)
    spec = SpeculativeDecoder(target, draft, MixedPolicy(ChainPolicy(3), pattern="p"), params, eos_ids=[])
    van = vanilla.VanillaDecoder(target, params, eos_ids=[])
    gen = lambda: torch.Generator().manual_seed(0)
    n1, n2 = 4, Drafter.MAX_PENDING - 4  # prompt + steps < MAX_PENDING: no catch-up falls due
    spec_ops, spec_reads, steps = _per_step(lambda n: spec.generate(prompts, n, gen()), n1, n2)
    van_ops, van_reads, _ = _per_step(lambda n: van.generate(prompts, n, gen()), n1, n2)
    # No head forward in any step: one per generate, at its end, over the prompt and every plain step at once.
    assert forwards == [3 + n1 - 1, 3 + n2 - 1] and steps == n2 - n1
    assert spec_reads == van_reads == 1
    assert abs(spec_ops - van_ops) <= 0.1 * van_ops, (spec_ops, van_ops)
    # A long plain run catches up once per MAX_PENDING steps, over all of them at once.
    forwards.clear()
    spec.generate(prompts, 2 * Drafter.MAX_PENDING + 5, gen())  # prompt 3 + 68 steps = 32 + 32 + 7 columns
    assert forwards == [Drafter.MAX_PENDING, Drafter.MAX_PENDING, 71 - 2 * Drafter.MAX_PENDING]


def test_mixed_steps_read_the_host_once_per_plain_step():
    target, draft = make_pair(1)
    dec = SpeculativeDecoder(target, draft, MixedPolicy(ChainPolicy(3), pattern="pppt"), eos_ids=[])
    with count_ops() as short:
        a = dec.generate([[1, 2], [3, 4, 5]], 9)
    with count_ops() as long:
        b = dec.generate([[1, 2], [3, 4, 5]], 49)
    assert (long.host_reads - short.host_reads) / (b.stats.steps - a.stats.steps) <= 1.0


@pytest.mark.parametrize("seed", range(3))
def test_compacting_decoder_cuts_pending_catch_up(seed):
    """Rows finish (and leave the batch) in the middle of plain runs: the pending pairs are cut with them."""
    target, draft = make_pair(seed)
    prompts = [p for p in prompts_for(seed, 3)] + [[7, 8]]
    free = vanilla.generate(target, prompts, 60, eos_ids=[]).tokens
    eos = [free[1][7], free[3][20]]
    mk = lambda: MixedPolicy(INNER["dynamic"](), seed, stay=0.7)
    want = vanilla.generate(target, prompts, 60, eos_ids=eos).tokens
    dec = CompactingDecoder(target, draft, mk(), eos_ids=eos)
    got = dec.generate(prompts, 60)
    assert got.tokens == want
    assert dec.drafter.batch < 4
    same = SpeculativeDecoder(target, draft, mk(), eos_ids=eos).generate(prompts, 60)
    assert (got.stats.steps, got.stats.row_steps) == (same.stats.steps, same.stats.row_steps)
