"""SpeculativeGenerationModule under trainer.predict: ragged batches decode exactly as SpeculativeDecoder.generate,
sampled records are seeded by their key (not their batch), and multi-turn requests see their own earlier replies."""
from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from treedec.decoding.speculative import CompactingDecoder, SpeculativeDecoder
from treedec.sampling import RowSeededGenerator, RowStreams, SamplingParams
from treedec.training.predict import Prompt, SpeculativeGenerationModule, row_seed
from treedec.tree.policies import AutoPolicy, ChainPolicy, DynamicPolicy, StaticPolicy

MAX_NEW, EOS = 14, [5]


def predict(module, batches) -> list[list]:
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    out = trainer.predict(module, dataloaders=DataLoader(batches, batch_size=None, collate_fn=lambda b: b))
    return [[getattr(r, "tokens", None) for r in o["requests"]] for o in out], out


def ragged_prompts(seed: int, lengths=(3, 11, 6, 1)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(6, 64, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("policy", [DynamicPolicy(10, 3, 4), StaticPolicy([[0], [1], [0, 0], [0, 1], [0, 0, 0]])],
                         ids=["dynamic", "static"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_predict_ragged_batch_equals_generate(tiny_target, tiny_head, policy, temperature):
    sampling = SamplingParams(temperature=temperature)
    module = SpeculativeGenerationModule(tiny_target, tiny_head, policy, sampling, MAX_NEW, eos_ids=EOS, seed=3)
    dec = SpeculativeDecoder(tiny_target, tiny_head, policy, sampling, eos_ids=EOS)
    for seed in range(3):
        prompts = ragged_prompts(seed)
        keys = [f"r{seed}-{i}" for i in range(len(prompts))]
        (got,), out = predict(module, [[Prompt(k, p) for k, p in zip(keys, prompts)]])
        gen = RowSeededGenerator([row_seed(3, k, 0) for k in keys])
        want = dec.generate(prompts, MAX_NEW, generator=gen)
        assert got == want.tokens
        assert out[0]["stats"].tau == want.stats.tau and out[0]["stats"].new_tokens == sum(map(len, want.tokens))
    if temperature == 0.0:  # the budget and EOS really made the batch ragged at least once
        assert len({len(t) for t in want.tokens}) > 1 or any(EOS[0] in t for t in want.tokens)


def test_sampled_record_does_not_depend_on_its_batch(tiny_target, tiny_head):
    """Row streams come from the record key: alone, first or last in a batch, a record draws the same tokens."""
    module = SpeculativeGenerationModule(tiny_target, tiny_head, DynamicPolicy(10, 3, 4), SamplingParams(1.0),
                                         MAX_NEW, eos_ids=[], seed=0)
    prompts = ragged_prompts(7, (4, 4, 4))  # equal lengths: the batched passes pad nothing
    together, _ = predict(module, [[Prompt(i, p) for i, p in enumerate(prompts)]])
    alone, _ = predict(module, [[Prompt(i, p)] for i, p in enumerate(prompts)][::-1])
    assert together[0] == [b[0] for b in alone[::-1]]
    assert len({tuple(t) for t in together[0]}) == 3  # distinct keys, distinct draws
    other, _ = predict(SpeculativeGenerationModule(tiny_target, tiny_head, DynamicPolicy(10, 3, 4),
                                                   SamplingParams(1.0), MAX_NEW, eos_ids=[], seed=1),
                       [[Prompt(i, p) for i, p in enumerate(prompts)]])
    assert other[0] != together[0]  # the job seed matters


class TwoTurns:
    """A request whose second prompt holds its first reply (as a chat's second assistant turn does)."""

    def __init__(self, key, first: list[int], second: list[int] | None):
        self.key, self.prompts, self.replies = key, [first], []
        self.second = second

    def next_prompt(self):
        if len(self.replies) == len(self.prompts):
            if self.second is None or len(self.prompts) == 2:
                return None
            self.prompts.append(self.prompts[0] + self.replies[0] + self.second)
        return self.prompts[-1]

    def take(self, tokens):
        self.replies.append(tokens)


def test_multi_turn_requests_decode_in_rounds(tiny_target, tiny_head):
    policy = DynamicPolicy(10, 3, 4)
    module = SpeculativeGenerationModule(tiny_target, tiny_head, policy, max_new_tokens=8, eos_ids=[])
    a, b, c = ragged_prompts(11, (5, 2, 7))
    reqs = [TwoTurns("a", a, [9, 10]), TwoTurns("b", b, None), TwoTurns("c", c, [12])]
    _, out = predict(module, [reqs])
    dec = SpeculativeDecoder(tiny_target, tiny_head, policy, eos_ids=[])
    first = dec.generate([a, b, c], 8).tokens
    second = dec.generate([a + first[0] + [9, 10], c + first[2] + [12]], 8).tokens  # "b" has left the batch
    assert [r.replies for r in out[0]["requests"]] == [[first[0], second[0]], [first[1]], [first[2], second[1]]]
    assert out[0]["stats"].new_tokens == 5 * 8


def test_long_prompt_keeps_its_end(tiny_target, tiny_head):
    module = SpeculativeGenerationModule(tiny_target, tiny_head, DynamicPolicy(10, 3, 4), max_new_tokens=24)
    ctx = tiny_target.config.context_length
    ids = list(range(ctx + 5))
    assert module.fit_prompt(ids) == ids[-(ctx - 24):]
    with pytest.raises(ValueError, match="leaves no room"):
        SpeculativeGenerationModule(tiny_target, tiny_head, DynamicPolicy(10, 3, 4), max_new_tokens=ctx).fit_prompt([1])


def test_row_seeds_name_the_streams():
    assert row_seed(0, "x", 1) == row_seed(0, "x", 1) != row_seed(0, "x", 0)
    a = RowStreams(RowSeededGenerator([4, 9]), 2, "cpu").rand(3)
    b = RowStreams(RowSeededGenerator([9]), 1, "cpu").rand(3)
    assert torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])
    with pytest.raises(ValueError, match="2 row seeds for a batch of 3"):
        RowStreams(RowSeededGenerator([1, 2]), 3, "cpu")


@pytest.mark.parametrize("policy", [DynamicPolicy(10, 3, 4), StaticPolicy([[0], [1], [0, 0], [1, 0]]), ChainPolicy(3)],
                         ids=["dynamic", "static", "chain"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_compacting_decoder_drops_finished_rows_and_decodes_the_same(tiny_target, tiny_head, policy, temperature):
    sampling = SamplingParams(temperature=temperature)
    for seed in range(3):
        prompts = ragged_prompts(20 + seed, (4, 9, 2, 6))
        gen = lambda seed=seed: RowSeededGenerator([seed * 10 + b for b in range(4)])
        free = SpeculativeDecoder(tiny_target, tiny_head, policy, sampling, eos_ids=[]).generate(prompts, 12, gen())
        eos = [free.tokens[1][2], free.tokens[3][5]]  # rows 1 and 3 stop early, the others may too
        want = SpeculativeDecoder(tiny_target, tiny_head, policy, sampling, eos_ids=eos).generate(prompts, 12, gen())
        dec = CompactingDecoder(tiny_target, tiny_head, policy, sampling, eos_ids=eos)
        got = dec.generate(prompts, 12, gen())
        assert got.tokens == want.tokens
        assert (got.stats.tau, got.stats.row_steps, got.stats.steps) == (want.stats.tau, want.stats.row_steps,
                                                                          want.stats.steps)
        assert dec.cache.batch == dec.drafter.batch < 4  # finished rows left the batch


@pytest.mark.parametrize("seed", range(3))
def test_compacting_decoder_with_the_auto_budget_stays_lossless(tiny_target, tiny_head, seed):
    """Rows leave the batch (the last live row moving into their slots) while the auto budget picks a tree per
    step from its clock: the trees differ from run to run, the greedy output does not."""
    pol = AutoPolicy(max_depth=4, top_k=3)
    prompts = ragged_prompts(40 + seed, (4, 9, 2, 6, 7, 3))
    free = SpeculativeDecoder(tiny_target, tiny_head, DynamicPolicy(8, 3, 3), eos_ids=[]).generate(prompts, 16)
    eos = [free.tokens[0][3], free.tokens[2][1], free.tokens[4][6]]  # rows stop early at different steps
    want = SpeculativeDecoder(tiny_target, tiny_head, ChainPolicy(1), eos_ids=eos).generate(prompts, 16)
    dec = CompactingDecoder(tiny_target, tiny_head, pol, eos_ids=eos)
    got = dec.generate(prompts, 16)
    assert got.tokens == want.tokens
    assert dec.cache.batch == dec.drafter.batch < len(prompts)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_batch_served_through_fewer_slots_decodes_the_same(tiny_target, tiny_head, temperature):
    """slots=2: the batch's prompts queue for two rows (continuous batching); each record's tokens (and, sampled,
    its draws, seeded by its key) are those of the whole batch decoded at once."""
    sampling = SamplingParams(temperature=temperature)
    prompts = ragged_prompts(30, (4, 9, 2, 6, 3, 7))
    outs = []
    for slots in (None, 2):
        module = SpeculativeGenerationModule(tiny_target, tiny_head, DynamicPolicy(10, 3, 4), sampling, MAX_NEW,
                                             eos_ids=EOS, seed=5, slots=slots)
        (got,), out = predict(module, [[Prompt(i, p) for i, p in enumerate(prompts)]])
        outs.append((got, out[0]["stats"]))
    assert outs[0][0] == outs[1][0]
    assert outs[0][1].prefills == 1 and outs[1][1].prefills > 2 and outs[1][1].steps > outs[0][1].steps
    with pytest.raises(ValueError, match="slots must be"):
        SpeculativeGenerationModule(tiny_target, tiny_head, DynamicPolicy(10, 3, 4), slots=0)
