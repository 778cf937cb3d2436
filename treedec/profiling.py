"""Count aten ops and host reads (device -> host syncs) of a block of code.

On a GPU every host read (``.item()``, ``bool(t)``, ``int(t)``, ``torch.equal``,
``.tolist()``) waits for the launch queue to drain, so the hot path should do as few as
possible per step, independently of the number of layers. ``count_ops`` makes that testable
on a CPU: it sees every aten op through a ``TorchDispatchMode`` and patches ``Tensor.tolist``
(which reads memory without dispatching an op).
"""
from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
HOST_READ_OPS = frozenset({_aten.item.default, _aten._local_scalar_dense.default, _aten.equal.default,
                           _aten.is_nonzero.default})


@dataclass
class OpCounts:
    aten_ops: int = 0  # every aten op dispatched (views and factories included)
    host_reads: int = 0  # item / _local_scalar_dense / equal / is_nonzero / Tensor.tolist calls
    ops: Counter = field(default_factory=Counter)  # op name -> count
    reads: Counter = field(default_factory=Counter)  # read kind -> count


class _Counter(TorchDispatchMode):
    def __init__(self, counts: OpCounts):
        super().__init__()
        self.counts, self.in_tolist = counts, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counts
        c.aten_ops += 1
        c.ops[func.name()] += 1
        # The mode is off while an op runs, so item's inner _local_scalar_dense is never seen twice;
        # inside a patched tolist (which counted itself) nothing more is a read.
        if func in HOST_READ_OPS and not self.in_tolist:
            c.host_reads += 1
            c.reads[func.name()] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def count_ops() -> Iterator[OpCounts]:
    """``with count_ops() as c: ...`` then ``c.aten_ops``, ``c.host_reads`` (and ``c.ops``, ``c.reads``)."""
    counts = OpCounts()
    mode = _Counter(counts)
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        counts.host_reads += 1
        counts.reads["tolist"] += 1
        mode.in_tolist += 1
        try:
            return tolist(self)
        finally:
            mode.in_tolist -= 1

    torch.Tensor.tolist = counted_tolist
    try:
        with mode:
            yield counts
    finally:
        torch.Tensor.tolist = tolist


__all__ = ["HOST_READ_OPS", "OpCounts", "count_ops"]
