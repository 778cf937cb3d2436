"""count_ops counts aten ops and host reads, and the model's forward does no host reads."""
from __future__ import annotations

import torch

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
