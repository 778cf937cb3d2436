"""The target model's invariants: incremental decoding, tree == branches, KV commit, rollback."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import full_logits, needs_triton, tiny_model
from treedec.attention.layout import pack_bits
from treedec.tree import Tree

ATOL = 2e-5


def backends(include_triton: bool = True):
    out = ["eager", "sdpa"]
    if include_triton:
        out.append(pytest.param("triton", marks=needs_triton))
    return out


def random_tree(T: int, gen: torch.Generator) -> Tree:
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]
    return Tree.from_parents(parents)


def rand_ids(n: int, gen: torch.Generator, V: int = 97) -> list[int]:
    return torch.randint(0, V, (n,), generator=gen).tolist()


# --------------------------------------------------------------------------- incremental decoding
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_incremental_equals_full_forward(backend, kv_heads):
    model = tiny_model(seed=kv_heads, backend=backend, num_key_value_heads=kv_heads)
    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([rand_ids(24, gen), rand_ids(24, gen)])
    want = full_logits(model, ids)
    cache = model.new_cache(2, 32)
    got = []
    with torch.inference_mode():
        for a, b in [(0, 7), (7, 12)]:  # chunked prefill
            got.append(model(ids[:, a:b], cache).logits)
            cache.advance(b - a)
        for t in range(12, 24):  # one-token steps
            got.append(model(ids[:, t:t + 1], cache, logits="last").logits)
            cache.advance(1)
    torch.testing.assert_close(torch.cat(got, 1), want, atol=ATOL, rtol=1e-4)
    assert int(cache.lengths[0]) == 24


def test_logits_selection_and_hidden():
    model = tiny_model(seed=1)
    ids = torch.tensor([rand_ids(9, torch.Generator().manual_seed(1))])
    full = full_logits(model, ids)
    with torch.inference_mode():
        out = model(ids, model.new_cache(1, 9), logits=torch.tensor([2, 5]), layer_inputs=(1,))
        torch.testing.assert_close(out.logits, full[:, [2, 5]])
        torch.testing.assert_close(model.lm_head(out.hidden), full, atol=ATOL, rtol=1e-4)
        assert set(out.layer_inputs) == {1}
        none = model(ids, model.new_cache(1, 9), logits="none")
        assert none.logits is None


# --------------------------------------------------------------------------- tree == branches
def check_tree_equals_branches(model, prefix: list[int], tree: Tree, tokens: list[int], atol=ATOL):
    L, T = len(prefix), len(tree)
    cache = model.new_cache(1, L + T)
    with torch.inference_mode():
        model(torch.tensor([prefix]), cache, logits="none")
        cache.advance(L)
        out = model(torch.tensor([tokens]), cache, position_ids=tree.position_ids(L)[None],
                    ancestor_bits=tree.ancestor_bits()).logits[0]
    assert int(cache.lengths[0]) == L  # a tree forward does not move the length
    for node in range(T):
        branch = prefix + [tokens[j] for j in tree.path_to(node)]
        want = full_logits(model, [branch])[0, -1]
        torch.testing.assert_close(out[node], want, atol=atol, rtol=1e-4, msg=lambda m, node=node: f"node {node}: {m}")


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("seed", range(4))
def test_tree_equals_branches(backend, seed):
    gen = torch.Generator().manual_seed(seed)
    model = tiny_model(seed=seed, backend=backend)
    T = [5, 17, 40, 29][seed]
    tree = random_tree(T, gen)
    check_tree_equals_branches(model, rand_ids(3 + 4 * seed, gen), tree, rand_ids(T, gen))


def test_tree_beyond_64_nodes():
    gen = torch.Generator().manual_seed(11)
    model = tiny_model(seed=11, backend="sdpa", num_key_value_heads=1)
    tree = random_tree(70, gen)
    assert tree.ancestor_bits().shape == (70, 2)
    check_tree_equals_branches(model, rand_ids(6, gen), tree, rand_ids(70, gen))


@needs_triton
def test_tree_equals_branches_triton():
    gen = torch.Generator().manual_seed(3)
    model = tiny_model(seed=3, backend="triton", num_hidden_layers=1)
    tree = random_tree(6, gen)
    check_tree_equals_branches(model, rand_ids(5, gen), tree, rand_ids(6, gen), atol=1e-4)


@pytest.mark.parametrize("backend", backends())
def test_ragged_batch_per_row_trees(backend):
    """Two rows, different prefix lengths, different trees ([B, T, W] bits, [B, T] positions)."""
    gen = torch.Generator().manual_seed(21)
    small = backend == "triton"
    model = tiny_model(seed=21, backend=backend, num_hidden_layers=1 if small else 2)
    T = 5 if small else 12
    prefixes = [rand_ids(4, gen), rand_ids(9, gen)]
    trees = [random_tree(T, gen), random_tree(T, gen)]
    tokens = [rand_ids(T, gen), rand_ids(T, gen)]
    lens = torch.tensor([len(p) for p in prefixes])
    cache = model.new_cache(2, int(lens.max()) + T)
    padded = torch.zeros(2, int(lens.max()), dtype=torch.long)
    for b, p in enumerate(prefixes):
        padded[b, : len(p)] = torch.tensor(p)
    bits = torch.stack([t.ancestor_bits() for t in trees])
    pos = torch.stack([t.position_ids(int(lens[b])) for b, t in enumerate(trees)])
    with torch.inference_mode():
        model(padded, cache, logits="none")
        cache.rollback(lens)
        out = model(torch.tensor(tokens), cache, position_ids=pos, ancestor_bits=bits).logits
    for b in range(2):
        for node in range(T):
            branch = prefixes[b] + [tokens[b][j] for j in trees[b].path_to(node)]
            torch.testing.assert_close(out[b, node], full_logits(model, [branch])[0, -1], atol=1e-4, rtol=1e-4)


def test_tree_with_sibling_tokens_equal():
    """Siblings holding the same token at the same position must still not see each other."""
    model = tiny_model(seed=4)
    tree = Tree.from_parents([-1, 0, 0, 1, 2, 2])
    check_tree_equals_branches(model, [1, 2, 3], tree, [7, 9, 9, 4, 4, 5])


# --------------------------------------------------------------------------- KV commit
def vanilla_cache(model, tokens: list[int]):
    cache = model.new_cache(1, len(tokens) + 1)
    with torch.inference_mode():
        model(torch.tensor([tokens]), cache, logits="none")
    cache.advance(len(tokens))
    return cache


def assert_cache_rows_equal(cache, b: int, ref, atol=ATOL):
    n = int(ref.lengths[0])
    assert int(cache.lengths[b]) == n
    torch.testing.assert_close(cache.k[:, b, :, :n], ref.k[:, 0, :, :n], atol=atol, rtol=1e-4)
    torch.testing.assert_close(cache.v[:, b, :, :n], ref.v[:, 0, :, :n], atol=atol, rtol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("seed", range(3))
def test_kv_commit_equals_vanilla(backend, seed):
    gen = torch.Generator().manual_seed(100 + seed)
    model = tiny_model(seed=seed, backend=backend)
    seq = rand_ids(6, gen)
    cache = model.new_cache(1, 200)
    with torch.inference_mode():
        model(torch.tensor([seq]), cache, logits="none")
        cache.advance(len(seq))
        for _ in range(6):
            T = int(torch.randint(1, 25, (1,), generator=gen))
            tree = random_tree(T, gen)
            toks = rand_ids(T, gen)
            model(torch.tensor([toks]), cache, position_ids=tree.position_ids(cache.lengths),
                  ancestor_bits=tree.ancestor_bits(), logits="none")
            node = int(torch.randint(0, T, (1,), generator=gen))
            path = tree.path_to(node)
            cache.commit(torch.tensor(path))
            seq += [toks[j] for j in path]
            assert_cache_rows_equal(cache, 0, vanilla_cache(model, seq))
    # and decoding continues exactly as vanilla
    nxt = rand_ids(3, gen)
    with torch.inference_mode():
        got = model(torch.tensor([nxt]), cache).logits
    torch.testing.assert_close(got, full_logits(model, [seq + nxt])[:, -3:], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_kv_commit_ragged_rows(backend):
    """Per-row trees and per-row accepted paths ([B, n] padded, n_accept per row) over several steps."""
    gen = torch.Generator().manual_seed(7)
    model = tiny_model(seed=7, backend=backend)
    seqs = [rand_ids(3, gen), rand_ids(8, gen)]
    B, T = 2, 15
    lens = torch.tensor([len(s) for s in seqs])
    cache = model.new_cache(B, 150)
    padded = torch.zeros(B, int(lens.max()), dtype=torch.long)
    for b, s in enumerate(seqs):
        padded[b, : len(s)] = torch.tensor(s)
    with torch.inference_mode():
        model(padded, cache, logits="none")
        cache.rollback(lens)
        for _ in range(5):
            trees = [random_tree(T, gen) for _ in range(B)]
            toks = [rand_ids(T, gen) for _ in range(B)]
            bits = torch.stack([t.ancestor_bits() for t in trees])
            pos = torch.stack([t.position_ids(int(cache.lengths[b])) for b, t in enumerate(trees)])
            model(torch.tensor(toks), cache, position_ids=pos, ancestor_bits=bits, logits="none")
            paths = [trees[b].path_to(int(torch.randint(0, T, (1,), generator=gen))) for b in range(B)]
            n = torch.tensor([len(p) for p in paths])
            width = int(n.max())
            path_t = torch.tensor([p + [0] * (width - len(p)) for p in paths])
            cache.commit(path_t, n)
            for b in range(B):
                seqs[b] += [toks[b][j] for j in paths[b]]
                assert_cache_rows_equal(cache, b, vanilla_cache(model, seqs[b]))


def test_rollback_then_decode():
    gen = torch.Generator().manual_seed(9)
    model = tiny_model(seed=9)
    seq = rand_ids(20, gen)
    cache = model.new_cache(1, 40)
    with torch.inference_mode():
        model(torch.tensor([seq]), cache, logits="none")
        cache.advance(20)
        cache.rollback(12)  # forget the last 8 tokens, then take a different continuation
        alt = rand_ids(5, gen)
        got = model(torch.tensor([alt]), cache).logits
        cache.advance(5)
    torch.testing.assert_close(got, full_logits(model, [seq[:12] + alt])[:, -5:], atol=ATOL, rtol=1e-4)
    assert_cache_rows_equal(cache, 0, vanilla_cache(model, seq[:12] + alt))


def test_context_overflow_is_a_clear_error():
    model = tiny_model(seed=0, max_position_embeddings=16)
    cache = model.new_cache(1, 64)
    with pytest.raises(ValueError, match="context"):
        with torch.inference_mode():
            model(torch.zeros(1, 17, dtype=torch.long), cache)
    small = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="KV cache overflow"):
        with torch.inference_mode():
            model(torch.zeros(1, 5, dtype=torch.long), small)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ancestor_bits_match_the_parent_chains(seed):
    """Packed bits against words built here from each node's parent chain (130 nodes: three words, bit 63 set)."""
    gen = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, i - 70), i, (1,), generator=gen)) for i in range(1, 130)]
    want = []
    for i in range(130):
        word, j = 0, i
        while j >= 0:  # the node itself, then each ancestor up to the root
            word |= 1 << j
            j = parents[j]
        want.append([(w - (1 << 64) if w >= 1 << 63 else w) for w in ((word >> (64 * k)) & (2**64 - 1)
                                                                     for k in range(3))])
    got = Tree.from_parents(parents).ancestor_bits()
    assert got.dtype == torch.int64 and got.tolist() == want
    assert any(w < 0 for row in want for w in row)  # some node has node 63 (or 127) as an ancestor


# --------------------------------------------------------------------------- tree_mask input, one mask per forward
@pytest.mark.parametrize("backend", backends())
def test_tree_mask_equals_ancestor_bits(backend):
    """A bool ancestry matrix and its packed bits give the same forward, per row and shared, ragged rows."""
    gen = torch.Generator().manual_seed(31)
    model = tiny_model(seed=31, backend=backend, num_hidden_layers=1 if backend == "triton" else 2)
    T = 6
    trees = [random_tree(T, gen), random_tree(T, gen)]
    lens = [3, 7]
    for per_row in (False, True):
        masks = torch.stack([t.mask() for t in trees]) if per_row else trees[0].mask()
        pos = torch.stack([(trees[b] if per_row else trees[0]).position_ids(lens[b]) for b in range(2)])
        ids = torch.tensor([rand_ids(T, gen), rand_ids(T, gen)])
        outs = []
        for kw in (dict(tree_mask=masks), dict(ancestor_bits=pack_bits(masks))):
            cache = model.new_cache(2, 16)
            with torch.inference_mode():
                model(torch.tensor([rand_ids(7, torch.Generator().manual_seed(0))] * 2), cache, logits="none")
                cache.rollback(lens)
                outs.append(model(ids, cache, position_ids=pos, **kw).logits)
        torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("seed", range(2))
def test_tree_equals_branches_with_tree_mask(backend, seed):
    gen = torch.Generator().manual_seed(40 + seed)
    model = tiny_model(seed=seed, backend=backend)
    tree = random_tree([9, 23][seed], gen)
    prefix, tokens = rand_ids(5, gen), rand_ids(len(tree), gen)
    L = len(prefix)
    cache = model.new_cache(1, L + len(tree))
    with torch.inference_mode():
        model(torch.tensor([prefix]), cache, logits="none")
        cache.advance(L)
        out = model(torch.tensor([tokens]), cache, position_ids=tree.position_ids(L)[None], tree_mask=tree.mask()).logits[0]
    for node in range(len(tree)):
        want = full_logits(model, [prefix + [tokens[j] for j in tree.path_to(node)]])[0, -1]
        torch.testing.assert_close(out[node], want, atol=ATOL, rtol=1e-4)


def test_bad_tree_inputs_are_clear_errors():
    model = tiny_model()
    tree = random_tree(3, torch.Generator().manual_seed(0))
    ids = torch.zeros(2, 3, dtype=torch.long)
    bad = [(dict(tree_mask=tree.mask(), ancestor_bits=tree.ancestor_bits()), "not both"),
           (dict(tree_mask=tree.mask().long()), "tree_mask must be torch.bool"),
           (dict(tree_mask=tree.mask()[:2, :2]), r"got torch.bool \(2, 2\)"),
           (dict(tree_mask=tree.mask()[None].expand(3, 3, 3)), "B=2"),
           (dict(ancestor_bits=tree.ancestor_bits().int()), "ancestor_bits must be torch.int64")]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=msg), torch.inference_mode():
            model(ids, model.new_cache(2, 8), **kw)


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("lens,S", [([4, 4], 10), ([4, 4], 13), ([0, 0], 6), ([2, 5], 11), ([0, 3], 15)])
def test_tree_dense_mask_matches_packed_path(host, lens, S):
    from treedec.attention import dense_mask, tree_dense_mask

    gen = torch.Generator().manual_seed(sum(lens) + S)
    trees = torch.stack([random_tree(6, gen).mask(), random_tree(6, gen).mask()])
    pl = torch.tensor(lens)
    for tm in (trees, trees[0]):
        want = dense_mask(pack_bits(tm), pl, 6, S)[:, None]
        got = tree_dense_mask(tm, pl, S, host_lens=lens if host else None)
        assert got.shape == (2, 1, 6, S) and got.dtype == torch.bool
        assert torch.equal(got, want)


def test_tree_dense_mask_is_a_few_ops():
    from treedec.attention import tree_dense_mask
    from treedec.profiling import count_ops

    tm = random_tree(16, torch.Generator().manual_seed(0)).mask()
    same_lens, ragged_lens = torch.tensor([9, 9]), torch.tensor([3, 9])
    with count_ops() as same:
        tree_dense_mask(tm, same_lens, 25, host_lens=[9, 9])
    with count_ops() as ragged:
        tree_dense_mask(tm, ragged_lens, 25)
    assert same.host_reads == ragged.host_reads == 0
    assert same.aten_ops <= 4 and ragged.aten_ops <= 12, (same.ops, ragged.ops)


def test_one_row_bf16_steps_use_aten_matmuls_and_give_the_same_outputs(monkeypatch):
    """A one-row bf16 step on a CPU runs its layers with oneDNN off (its fixed cost per matmul dwarfs one row's
    work) and its LM head with it on (as fast or 3x faster at 8192 outputs), computes the same logits as with
    oneDNN on throughout, and leaves the global flag as it found it."""
    m = tiny_model().to(torch.bfloat16)
    seen, head = [], []
    layer = m.model.layers[0]
    orig = type(layer).forward
    monkeypatch.setattr(type(layer), "forward", lambda self, *a: seen.append(torch.backends.mkldnn.enabled) or orig(self, *a))
    m.lm_head.register_forward_pre_hook(lambda mod, args: head.append(torch.backends.mkldnn.enabled))
    ids = torch.randint(0, m.config.vocab_size, (1, 5))
    cache = m.new_cache(1, 16)
    m(ids[:, :4], cache)
    cache.advance(4)
    step = m(ids[:, 4:], cache).logits  # one row, one token
    n_layers = len(m.model.layers)
    assert seen[:n_layers] == [True] * n_layers and seen[n_layers:] == [False] * n_layers
    assert head == [True, True]  # the prefill's and the one-row step's LM heads
    assert torch.backends.mkldnn.enabled
    two = m.new_cache(2, 16)  # the same step as two identical rows: oneDNN's matmuls
    m(ids[:, :4].expand(2, 4), two)
    two.advance(4)
    seen.clear()
    ref = m(ids[:, 4:].expand(2, 1), two).logits[:1]
    assert all(seen)
    assert torch.allclose(step.float(), ref.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_table_rows_are_rope_cos_sin_bit_for_bit(dtype, monkeypatch):
    """A forward's cos/sin are rows of a per-model table (one index op instead of nine): the same values as computing
    them for the positions at hand, rebuilt when the model changes dtype, and computed directly where a table would
    be too large (a very long context), with the same forward outputs either way."""
    from treedec.models import llama
    from treedec.profiling import count_ops

    m = tiny_model().to(dtype)
    pos = torch.randint(0, m.config.max_position_embeddings, (3, 7), generator=torch.Generator().manual_seed(0))
    cos, sin = llama.rope_lookup(m, pos, m.config.max_position_embeddings, dtype)
    want = llama.rope_cos_sin(pos, m.inv_freq)
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, want[0].to(dtype)) and torch.equal(sin, want[1].to(dtype))
    # a slot past the context (a padding column, a finished row) reads the table's slack, and one past that the last
    # row: never an index error (a device-side assert on a GPU)
    n = m.config.max_position_embeddings
    near, far = torch.tensor([[n + 3]]), torch.tensor([[n + 10 ** 6]])
    assert torch.equal(llama.rope_lookup(m, near, n, dtype)[0], llama.rope_cos_sin(near, m.inv_freq)[0].to(dtype))
    last = torch.tensor([[n + llama.ROPE_TABLE_SLACK - 1]])
    assert torch.equal(llama.rope_lookup(m, far, n, dtype)[1], llama.rope_lookup(m, last, n, dtype)[1])
    m.to(torch.float32 if dtype == torch.bfloat16 else torch.bfloat16)  # a new dtype: a new table
    other = llama.rope_lookup(m, pos, m.config.max_position_embeddings, m.dtype)[0]
    assert other.dtype == m.dtype and torch.equal(other, llama.rope_cos_sin(pos, m.inv_freq)[0].to(m.dtype))
    m.to(dtype)
    ids = torch.randint(0, m.config.vocab_size, (2, 6))
    m(ids, m.new_cache(2, 16))  # the table for this dtype, built once
    with count_ops() as table:
        ref = m(ids, m.new_cache(2, 16)).logits
    monkeypatch.setattr(llama, "ROPE_TABLE_BYTES", 0)
    m._rope_table = None
    with count_ops() as direct:
        got = m(ids, m.new_cache(2, 16)).logits
    assert torch.equal(got, ref)
    assert direct.aten_ops - table.aten_ops >= 5, (table.ops, direct.ops)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_is_hf_rotate_half(dtype):
    """One roll against rope_cos_sin's signed sin gives HF's ``x * cos + rotate_half(x) * sin`` bit for bit."""
    from treedec.models.llama import apply_rope, rope_cos_sin

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 9, 16, generator=g).to(dtype)[:, 1:]  # a strided view, as q/k are
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    pos = torch.randint(0, 500, (2, 9), generator=g)
    cos, sin = rope_cos_sin(pos, inv)
    emb = torch.cat((pos[..., None].float() * inv,) * 2, -1)[:, None]
    hf_sin = emb.sin().to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    want = x * cos.to(dtype) + torch.cat((-x2, x1), dim=-1) * hf_sin
    assert torch.equal(apply_rope(x, cos, sin), want)
