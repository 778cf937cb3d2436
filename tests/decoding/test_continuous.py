"""Continuous batching (``Decoder.serve``): a queue of prompts through a few batch slots decodes every prompt
exactly as decoding it alone would, whatever the slots, policy, EOS pattern or sampling."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from treedec.decoding.speculative import CompactingDecoder, SpeculativeDecoder
from treedec.decoding.vanilla import VanillaDecoder
from treedec.sampling import RowSeededGenerator, SamplingParams
from treedec.tree.policies import AutoPolicy, ChainPolicy, DynamicPolicy, LookupPolicy, StaticPolicy

POLICIES = {
    "dynamic": lambda: DynamicPolicy(10, 3, 4),
    "static": lambda: StaticPolicy([[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
    "chain": lambda: ChainPolicy(4),
    "auto": lambda: AutoPolicy(max_depth=4, top_k=3),
    "lookup": lambda: LookupPolicy(ChainPolicy(3), tokens=6),
}


def prompts_for(seed: int, n: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 24, (n,), generator=g).tolist()
    return [torch.randint(6, 64, (k,), generator=g).tolist() for k in lengths]


def stop_tokens(target, prompts, n: int) -> list[int]:
    """EOS ids that make rows stop at different steps (some at once, some never)."""
    free = VanillaDecoder(target, eos_ids=[]).generate(prompts, n).tokens
    return [free[1][0], free[3][n // 3], free[4][n // 2]]


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("slots", [1, 3])
def test_served_prompts_decode_as_each_alone_greedy_fp32(tiny_target, tiny_head, name, slots):
    for seed in range(2):
        prompts = prompts_for(seed)
        eos = stop_tokens(tiny_target, prompts, 18)
        want = [VanillaDecoder(tiny_target, eos_ids=eos).generate([p], 18).tokens[0] for p in prompts]
        dec = CompactingDecoder(tiny_target, tiny_head, POLICIES[name](), eos_ids=eos)
        got = dec.serve(prompts, 18, slots=slots)
        assert got.tokens == want
        assert got.stats.prefills > 1 and got.stats.batch == slots  # finished rows' slots were refilled
        assert dec.cache.batch == dec.drafter.batch <= slots
        assert got.stats.new_tokens == sum(map(len, want))
        assert got.stats.row_steps >= got.stats.steps  # a pass covers one row or more
        if name in ("static", "chain", "dynamic"):  # a row's tree is its own: the newcomers' draft state carried over
            alone = [CompactingDecoder(tiny_target, tiny_head, POLICIES[name](), eos_ids=eos).generate([p], 18).stats
                     for p in prompts]
            assert got.stats.row_steps == sum(a.row_steps for a in alone)
            assert got.stats.accepted == sum((a.accepted for a in alone), Counter())
    assert len({len(t) for t in want}) > 1  # EOS made the rows ragged


@pytest.mark.parametrize("compact", [True, False])
def test_vanilla_serves_a_queue_as_it_generates_one_batch(tiny_target, compact):
    prompts = prompts_for(5, 6)
    eos = stop_tokens(tiny_target, prompts, 16)
    dec = VanillaDecoder(tiny_target, eos_ids=eos)
    want = dec.generate(prompts, 16).tokens
    got = dec.serve(prompts, 16, slots=2, compact=compact)
    assert got.tokens == want and got.stats.prefills >= 3
    assert dec.cache.batch == (1 if compact else 2)  # compacted: the last prompt decoding alone at the end


def test_frozen_rows_ride_along_when_not_compacting(tiny_target, tiny_head):
    """compact=False (static shapes, as a compiled verify needs): slots are refilled, never cut."""
    prompts = prompts_for(9, 6)
    eos = stop_tokens(tiny_target, prompts, 16)
    want = [VanillaDecoder(tiny_target, eos_ids=eos).generate([p], 16).tokens[0] for p in prompts]
    dec = SpeculativeDecoder(tiny_target, tiny_head, POLICIES["dynamic"](), eos_ids=eos)
    got = dec.serve(prompts, 16, slots=4)
    assert got.tokens == want and dec.cache.batch == 4


@pytest.mark.parametrize("name", ["dynamic", "chain", "lookup"])
def test_a_sampled_prompt_draws_the_same_tokens_in_any_number_of_slots(tiny_target, tiny_head, name):
    """Each prompt's stream is named by its own seed, so sampled output does not depend on the slots."""
    prompts = prompts_for(3, 5)
    sampling = SamplingParams(temperature=0.9)
    seeds = [11, 22, 33, 44, 55]
    runs = [CompactingDecoder(tiny_target, tiny_head, POLICIES[name](), sampling, eos_ids=[])
            .serve(prompts, 12, slots=k, generator=RowSeededGenerator(seeds)).tokens for k in (5, 2, 1)]
    assert runs[0] == runs[1] == runs[2]
    assert len({tuple(t) for t in runs[0]}) == 5
    # a plain generator: one base draw names every prompt's stream, as generate() does for a whole batch
    whole = VanillaDecoder(tiny_target, sampling, eos_ids=[]).generate(prompts, 12, torch.Generator().manual_seed(4))
    served = VanillaDecoder(tiny_target, sampling, eos_ids=[]).serve(prompts, 12, 2, torch.Generator().manual_seed(4))
    assert whole.tokens == served.tokens


def test_stream_and_hook_see_prompts_not_slots(tiny_target, tiny_head):
    prompts = prompts_for(2, 5)
    eos = stop_tokens(tiny_target, prompts, 14)
    streamed: dict[int, list[int]] = {i: [] for i in range(5)}
    steps = []
    dec = CompactingDecoder(tiny_target, tiny_head, POLICIES["static"](), eos_ids=eos)
    out = dec.serve(prompts, 14, slots=2, stream=lambda b, t: streamed[b].extend(t), hook=steps.append)
    assert [streamed[i] for i in range(5)] == out.tokens
    assert all(len(s.tokens) == 5 and s.tree is None for s in steps)
    assert all(sum(s.active) <= 2 for s in steps) and len(steps) == out.stats.steps


def test_prompts_done_at_their_first_token_free_their_slot_at_once(tiny_target, tiny_head):
    prompts = prompts_for(4, 6)
    got = CompactingDecoder(tiny_target, tiny_head, POLICIES["chain"](), eos_ids=[]).serve(prompts, 1, slots=2)
    want = VanillaDecoder(tiny_target, eos_ids=[]).generate(prompts, 1).tokens
    assert got.tokens == want and got.stats.steps == 0 and got.stats.prefills == 3


def test_a_callers_cache_is_never_cut(tiny_target):
    cache = tiny_target.new_cache(2, 64)
    dec = VanillaDecoder(tiny_target, cache=cache)
    with pytest.raises(ValueError, match="compact=False"):
        dec.serve(prompts_for(1, 3), 8, slots=2, compact=True)
    assert cache.batch == 2
    assert dec.serve(prompts_for(1, 3), 8, slots=2).tokens == VanillaDecoder(tiny_target).generate(
        prompts_for(1, 3), 8).tokens


@pytest.mark.parametrize("slots", [0, -1, 1.5, True, "2"])
def test_slots_must_be_a_positive_whole_number(tiny_target, slots):
    with pytest.raises(ValueError, match="slots must be a whole number >= 1"):
        VanillaDecoder(tiny_target).serve([[1, 2]], 4, slots=slots)


def test_more_slots_than_prompts_is_one_batch(tiny_target, tiny_head):
    prompts = prompts_for(6, 3)
    dec = SpeculativeDecoder(tiny_target, tiny_head, POLICIES["chain"](), eos_ids=[])
    got = dec.serve(prompts, 10, slots=8)
    assert got.tokens == dec.generate(prompts, 10).tokens and got.stats.batch == 3 and got.stats.prefills == 1
