"""KVCache: the host mirror of the lengths stays exact without device reads; commit moves every layer at once."""
from __future__ import annotations

import pytest
import torch

from treedec.models.cache import KVCache
from treedec.profiling import count_ops


def filled_cache(B=3, L=2, H=2, S=24, D=4, seed=0) -> KVCache:
    c = KVCache(L, B, H, S, D)
    g = torch.Generator().manual_seed(seed)
    c.k.copy_(torch.randn(c.k.shape, generator=g))
    c.v.copy_(torch.randn(c.v.shape, generator=g))
    return c


def assert_mirror(c: KVCache) -> None:
    assert c.host_lengths == c.lengths.tolist()


def test_host_forms_cost_no_device_read():
    c = filled_cache()
    with count_ops() as ops:
        c.advance(5)
        c.advance([1, 2, 3])
        c.rollback([4, 7, 6])
        c.commit(torch.tensor([[0, 1, 3], [0, 2, 0], [0, 0, 0]]), torch.tensor([3, 2, 1]), n_host=[3, 2, 1])
        c.check_room(4)
        c.write(0, torch.zeros(3, 2, 4, 4), torch.zeros(3, 2, 4, 4))
        c.rollback(2)
        c.commit(torch.tensor([0, 1]), 2)  # an int count is known on the host too
        c.reset()
        c.advance(torch.tensor([1, 2, 3]).tolist())  # (the read is the caller's)
    assert ops.host_reads == 1 and ops.reads["tolist"] == 1
    assert_mirror(c)
    assert c.host_lengths == [1, 2, 3]


def test_tensor_forms_read_once_and_stay_exact():
    c = filled_cache()
    for call in (lambda: c.advance(torch.tensor([2, 0, 1])), lambda: c.rollback(torch.tensor([5, 6, 7])),
                 lambda: c.commit(torch.tensor([[0, 2], [0, 1], [0, 1]]), torch.tensor([2, 1, 2]))):
        with count_ops() as ops:
            call()
        assert ops.host_reads == 1
        assert_mirror(c)
    assert c.host_lengths == [7, 7, 9]


def test_outside_mutation_of_lengths_is_detected():
    c = filled_cache()
    c.advance(2)
    c.lengths.fill_(5)  # behind the cache's back: the next use re-reads (once), then it is free again
    with count_ops() as ops:
        keys, _ = c.write(1, torch.ones(3, 2, 2, 4), torch.ones(3, 2, 2, 4))
    assert ops.host_reads == 1 and keys.shape[2] == 7 and c.host_lengths == [5, 5, 5]
    assert (c.k[1, :, :, 5:7] == 1).all()
    with count_ops() as ops:
        c.check_room(10)
    assert ops.host_reads == 0
    with pytest.raises(ValueError, match="KV cache overflow"):
        c.check_room(20)


def test_write_slice_or_scatter_and_key_range():
    c = filled_cache()
    k = torch.randn(3, 2, 4, 4)
    with count_ops() as ops:
        keys, vals = c.write(0, k, -k)  # equal lengths: a slice write
    assert ops.host_reads == 0 and "aten::scatter_" not in [n.replace(".src", "") for n in ops.ops]
    assert keys.shape[2] == 4 and torch.equal(c.k[0, :, :, :4], k) and torch.equal(vals, -k)
    c.rollback([0, 3, 9])
    with count_ops() as ops:
        keys, _ = c.write(1, k, -k)
    assert ops.host_reads == 0 and keys.shape[2] == 13
    for b, L in enumerate([0, 3, 9]):
        assert torch.equal(c.k[1, b, :, L:L + 4], k[b]) and torch.equal(c.v[1, b, :, L:L + 4], -k[b])


@pytest.mark.parametrize("with_host", [False, True])
def test_commit_moves_the_path_in_every_layer(with_host):
    c = filled_cache(B=3, L=3)
    c.rollback([2, 5, 0])
    k0, v0 = c.k.clone(), c.v.clone()
    path = torch.tensor([[0, 2, 5, 6], [0, 1, 0, 0], [0, 3, 4, 0]])
    n = torch.tensor([4, 2, 3])
    c.commit(path, n, n_host=[4, 2, 3] if with_host else None)
    assert c.host_lengths == [6, 7, 3] and c.lengths.tolist() == [6, 7, 3]
    for b, (L, m) in enumerate([(2, 4), (5, 2), (0, 3)]):
        src = [L + int(j) for j in path[b, :m]]
        torch.testing.assert_close(c.k[:, b, :, L:L + m], k0[:, b, :, src], atol=0, rtol=0)
        torch.testing.assert_close(c.v[:, b, :, L:L + m], v0[:, b, :, src], atol=0, rtol=0)
        torch.testing.assert_close(c.k[:, b, :, :L], k0[:, b, :, :L], atol=0, rtol=0)  # the prefix is untouched


def test_commit_of_roots_only_moves_nothing():
    c = filled_cache()
    c.advance([1, 4, 2])
    k0 = c.k.clone()
    with count_ops() as ops:
        c.commit(torch.zeros(3, 1, dtype=torch.long), torch.tensor([1, 0, 1]), n_host=[1, 0, 1])
    assert ops.host_reads == 0 and not any("gather" in n or "scatter" in n for n in ops.ops)
    assert torch.equal(c.k, k0) and c.host_lengths == [2, 4, 3]
    assert_mirror(c)


def test_commit_is_one_indexed_copy_per_buffer_for_all_layers():
    c = filled_cache(L=6)
    with count_ops() as ops:
        c.commit(torch.tensor([[0, 1, 2]] * 3), torch.tensor([3, 3, 2]), n_host=[3, 3, 2])
    # One read (index) and one write (index_put_) per buffer, whatever the number of layers; no scatter_,
    # which is ~30x slower for bf16 on CPUs.
    assert ops.ops["aten::index.Tensor"] == 2 and ops.ops["aten::index_put_"] == 2 and ops.host_reads == 0
    assert not any("scatter" in name or "gather" in name for name in ops.ops)


def test_ragged_writes_use_no_scatter():
    c = filled_cache(L=2)
    c.rollback([3, 5, 4])
    with count_ops() as ops:
        c.write(0, torch.ones(3, c.k.shape[2], 2, c.k.shape[-1]), torch.ones(3, c.k.shape[2], 2, c.k.shape[-1]))
    assert ops.ops["aten::index_put_"] == 2 and not any("scatter" in name for name in ops.ops)


@pytest.mark.parametrize("rows", [[1, 3, 4], [0, 2], [0, 1, 2, 3, 4], [4], [0, 1, 4], [0, 4, 2], [3, 1, 0, 2]])
def test_keep_rows_keeps_each_rows_state_in_place(rows):
    c = filled_cache(B=5, S=30)
    c.rollback([7, 3, 12, 9, 5])
    before = [(c.k[:, r, :, :L].clone(), c.v[:, r, :, :L].clone(), L) for r, L in enumerate(c.host_lengths)]
    storage = c.k.untyped_storage().data_ptr()
    with count_ops() as ops:
        c.keep_rows(rows)
    assert ops.host_reads == 0
    assert c.batch == len(rows) and c.k.untyped_storage().data_ptr() == storage  # a view: nothing allocated
    assert c.host_lengths == [before[r][2] for r in rows]
    assert_mirror(c)
    for j, r in enumerate(rows):
        k, v, L = before[r]
        assert torch.equal(c.k[:, j, :, :L], k) and torch.equal(c.v[:, j, :, :L], v)
    # the cut cache goes on working: a ragged write and a commit land in the kept rows' own slots
    new = torch.randn(len(rows), 2, 2, 4)
    keys, _ = c.write(1, new, new)
    for j, L in enumerate(c.host_lengths):
        assert torch.equal(keys[j, :, L:L + 2], new[j])
    c.commit(torch.tensor([0, 1]), 2)
    assert c.host_lengths == [before[r][2] + 2 for r in rows]
    assert_mirror(c)


@pytest.mark.parametrize("rows", [[2, 2], [0, 0], [5], [-1, 2]])
def test_keep_rows_rejects_rows_it_does_not_hold(rows):
    c = filled_cache(B=5)
    with pytest.raises(ValueError, match="distinct rows"):
        c.keep_rows(rows)
    assert c.batch == 5


@pytest.mark.parametrize("slots", [[1], [3, 0], [2, 4, 1]])
def test_put_rows_loads_new_rows_into_their_slots_and_leaves_the_others(slots):
    c = filled_cache(B=5, S=30)
    c.rollback([7, 3, 12, 9, 5])
    c.keep_rows([0, 1, 2, 3, 4])  # (no-op cut: put_rows works on a cache that was cut before, too)
    before = [(c.k[:, r, :, :L].clone(), c.v[:, r, :, :L].clone(), L) for r, L in enumerate(c.host_lengths)]
    new = filled_cache(B=len(slots), S=10, seed=1)
    new.rollback([4 + i for i in range(len(slots))])
    with count_ops() as ops:
        c.put_rows(slots, new)
    assert ops.host_reads == 0
    assert_mirror(c)
    for r in range(5):
        if r in slots:
            i, L = slots.index(r), 4 + slots.index(r)
            assert c.host_lengths[r] == L
            assert torch.equal(c.k[:, r, :, :L], new.k[:, i, :, :L])
            assert torch.equal(c.v[:, r, :, :L], new.v[:, i, :, :L])
        else:
            k, v, L = before[r]
            assert c.host_lengths[r] == L and torch.equal(c.k[:, r, :, :L], k) and torch.equal(c.v[:, r, :, :L], v)
    new_kv = torch.randn(5, 2, 1, 4)  # the refilled cache goes on working: a ragged write lands after each length
    keys, _ = c.write(0, new_kv, new_kv)
    for j, L in enumerate(c.host_lengths):
        assert torch.equal(keys[j, :, L], new_kv[j, :, 0])


def test_put_rows_rejects_bad_slots_and_shapes():
    c = filled_cache(B=3)
    with pytest.raises(ValueError, match="distinct slots"):
        c.put_rows([0, 0], filled_cache(B=2))
    with pytest.raises(ValueError, match="distinct slots"):
        c.put_rows([3], filled_cache(B=1))
    with pytest.raises(ValueError, match="head dim"):
        c.put_rows([0], KVCache(2, 1, 2, 8, 6))
    big = filled_cache(B=1, S=40)
    big.rollback(30)
    with pytest.raises(ValueError, match="does not fit"):
        c.put_rows([1], big)
    assert c.host_lengths == [0, 0, 0]
