"""Vanilla decoding: the baseline that speculative decoding must reproduce."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import full_logits, tiny_model
from treedec.decoding.vanilla import generate
from treedec.sampling import SamplingParams

SAMPLE = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, max_position_embeddings=256)


def reference_greedy(model, prompt: list[int], n: int) -> list[int]:
    """No cache: re-run a full forward over everything at every step and take the argmax."""
    seq, out = list(prompt), []
    for _ in range(n):
        t = int(full_logits(model, [seq])[0, -1].argmax())
        out.append(t)
        seq.append(t)
    return out


@pytest.fixture(scope="module")
def greedy_ref(model):
    prompt = [5, 17, 2, 88, 40]
    return prompt, reference_greedy(model, prompt, 48)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_greedy_equals_full_forward_argmax(backend, greedy_ref):
    model = tiny_model(seed=3, backend=backend, max_position_embeddings=256)  # the module's model, per backend
    prompt, want = greedy_ref
    res = generate(model, prompt, len(want), eos_ids=[])
    assert res.tokens == [want]
    d = res.stats.as_dict()
    assert d["target_forwards"] == len(want) and d["new_tokens"] == len(want) and d["tau"] == 1.0
    assert res.stats.total_time > 0 and d["tokens_per_s"] > 0


def test_tensor_and_list_prompts_agree(model):
    a = generate(model, torch.tensor([[1, 2, 3], [4, 5, 6]]), 8, eos_ids=[])
    b = generate(model, [[1, 2, 3], [4, 5, 6]], 8, eos_ids=[])
    c = generate(model, torch.tensor([1, 2, 3]), 8, eos_ids=[])
    assert a.tokens == b.tokens and c.tokens == [a.tokens[0]]


def test_eos_stops(model):
    prompt = [9, 8, 7]
    free = generate(model, prompt, 30, eos_ids=[]).tokens[0]
    k = 6
    eos = free[k]
    first = free.index(eos)  # the first time that token appears
    res = generate(model, prompt, 30, eos_ids=[eos])
    assert res.tokens[0] == free[: first + 1] and res.tokens[0][-1] == eos
    assert res.stats.as_dict()["target_forwards"] == first + 1
    # EOS from the model config is the default
    model.config.eos_token_id = eos
    try:
        assert generate(model, prompt, 30).tokens[0] == free[: first + 1]
    finally:
        model.config.eos_token_id = None


@pytest.mark.parametrize("n", [0, 1, 2, 17])
def test_max_new_tokens_exact(model, n):
    res = generate(model, [[1, 2], [3, 4, 5, 6]], n, eos_ids=[])
    assert [len(r) for r in res.tokens] == [n, n]


def test_seeded_sampling(model):
    prompt = [3, 1, 4, 1, 5]
    run = lambda seed: generate(model, prompt, 40, SAMPLE, eos_ids=[],
                                generator=torch.Generator().manual_seed(seed)).tokens
    assert run(0) == run(0)
    assert run(0) != run(1)
    top1 = generate(model, prompt, 20, SamplingParams(temperature=0.7, top_k=1), eos_ids=[],
                    generator=torch.Generator().manual_seed(0)).tokens
    assert top1 == generate(model, prompt, 20, eos_ids=[]).tokens  # top-k 1 sampling is greedy


def test_ragged_batch_equals_per_row(model):
    prompts = [[1, 2, 3], [10, 20, 30, 40, 50, 60, 70], [5], [9, 9, 9, 9]]
    batch = generate(model, prompts, 25, eos_ids=[])
    for p, toks in zip(prompts, batch.tokens):
        assert toks == generate(model, p, 25, eos_ids=[]).tokens[0]
    # with EOS, rows finish at different steps and stop emitting
    eos = batch.tokens[1][4]
    stopped = generate(model, prompts, 25, eos_ids=[eos])
    for p, toks in zip(prompts, stopped.tokens):
        assert toks == generate(model, p, 25, eos_ids=[eos]).tokens[0]
    assert len(stopped.tokens[1]) <= 5


def test_ragged_batch_sampling_equals_per_row_distribution(model):
    """Sampled batches use the same per-row distribution: top-k 1 makes it deterministic to compare."""
    prompts = [[1, 2, 3], [10, 20, 30, 40, 50]]
    params = SamplingParams(temperature=1.0, top_k=1)
    batch = generate(model, prompts, 12, params, eos_ids=[], generator=torch.Generator().manual_seed(0))
    for p, toks in zip(prompts, batch.tokens):
        assert toks == generate(model, p, 12, eos_ids=[]).tokens[0]


def test_stream_and_cache_reuse(model):
    seen: dict[int, list[int]] = {0: [], 1: []}
    res = generate(model, [[1, 2], [3, 4, 5]], 10, eos_ids=[], stream=lambda b, t: seen[b].extend(t))
    assert [seen[0], seen[1]] == res.tokens
    cache = model.new_cache(2, 64)
    again = generate(model, [[1, 2], [3, 4, 5]], 10, eos_ids=[], cache=cache)
    assert again.tokens == res.tokens
    assert generate(model, [[1, 2], [3, 4, 5]], 10, eos_ids=[], cache=cache).tokens == res.tokens  # reset on reuse
    with pytest.raises(ValueError, match="cache"):
        generate(model, [[1, 2], [3, 4, 5]], 10, cache=model.new_cache(2, 8))


def test_prompt_longer_than_context_fails_before_work():
    model = tiny_model(seed=0, max_position_embeddings=32)
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="longer than the model's context of 32"):
        generate(model, list(range(40)), 5)
    with pytest.raises(ValueError, match="lower max_new_tokens to at most 2"):
        generate(model, [list(range(30)), [1]], 5)
    assert not calls
    assert len(generate(model, list(range(30)), 2, eos_ids=[]).tokens[0]) == 2


def test_bad_prompts(model):
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1, 2], []], 3)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        generate(model, [1, 2, 1000], 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [1, 2], -1)


def test_bf16_runs(model):
    m = tiny_model(seed=3, max_position_embeddings=256).to(torch.bfloat16)
    res = generate(m, [1, 2, 3], 10, eos_ids=[])
    assert len(res.tokens[0]) == 10
