"""count_ops counts aten ops and host reads, and the model's forward does no host reads."""
from __future__ import annotations

import torch

from tests.helpers import NO_TRITON
from treedec.profiling import count_ops


def test_count_ops_on_known_snippets():
    x = torch.arange(6.0)
    with count_ops() as c:
        x.sum().item()
    assert (c.aten_ops, c.host_reads) == (2, 1)  # sum, then one read (item is not counted twice)
    with count_ops() as c:
        x.tolist()
    assert (c.aten_ops, c.host_reads) == (0, 1)
    with count_ops() as c:
        bool(x.any()), int(x[2]), torch.equal(x, x)
    assert c.host_reads == 3
    with torch.inference_mode(), count_ops() as c:  # inference mode dispatches aten.item / is_nonzero themselves
        x.max().item(), bool(x[1])
    assert c.host_reads == 2
    with count_ops() as c:
        y = (x * 2 + 1).exp()
    assert (c.aten_ops, c.host_reads) == (3, 0) and y.shape == x.shape
    assert torch.Tensor.tolist(x) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the patch is undone


def test_count_ops_restores_tolist_on_error():
    original = torch.Tensor.tolist
    try:
        with count_ops():
            raise KeyError("boom")
    except KeyError:
        pass
    assert torch.Tensor.tolist is original


def _forward_counts(n_layers: int, backend: str, ragged: bool, given: bool):
    from tests.helpers import tiny_model
    from treedec.tree import Tree

    model = tiny_model(seed=n_layers, backend=backend, num_hidden_layers=n_layers)
    tree = Tree.from_parents([-1, 0, 0, 1, 1, 2, 3, 3])
    cache = model.new_cache(2, 32)
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(torch.zeros(2, 9, dtype=torch.long), cache, logits="none")
        cache.rollback([5, 9] if ragged else 9)
        pos = cache.lengths[:, None] + tree.depth[None]
        kw = dict(position_ids=pos, tree_mask=tree.mask()) if given else {}
        with count_ops() as c:
            model(ids, cache, **kw)
    return c


def test_forward_does_no_host_reads():
    """2 and 12 layers, shared or ragged lengths, tree or default chain, eager or sdpa: not one read."""
    for backend in ("eager", "sdpa"):
        for ragged in (False, True):
            for given in (True, False):
                counts = {L: _forward_counts(L, backend, ragged, given) for L in (2, 12)}
                assert [c.host_reads for c in counts.values()] == [0, 0], (backend, ragged, given,
                                                                           [c.reads for c in counts.values()])
    per_layer = (_forward_counts(12, "sdpa", False, True).aten_ops - _forward_counts(2, "sdpa", False, True).aten_ops) / 10
    assert per_layer <= 42, per_layer  # 40 today (was 63 before fusing and trimming no-op casts)


def test_triton_forward_does_no_host_reads():
    import pytest

    pytest.importorskip("triton", reason=NO_TRITON)
    c = _forward_counts(2, "triton", True, True)
    assert c.host_reads == 0, c.reads
