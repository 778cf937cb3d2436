"""The static-shape forward (whole-cache attention, device-side writes) and its compiled form."""
from __future__ import annotations

import time

import pytest
import torch

from tests.helpers import NO_TRITON, tiny_model
from treedec.profiling import count_ops
from treedec.tree import Tree

TREE = Tree.from_parents([-1, 0, 0, 1, 1, 2, 3, 3])


def two_caches(model, lens, max_len=40):
    """Two caches holding the same ragged prefixes: one for the dynamic forward, one for the static."""
    pre = torch.randint(0, 97, (len(lens), max(lens)), generator=torch.Generator().manual_seed(0))
    caches = []
    with torch.inference_mode():
        for _ in range(2):
            c = model.new_cache(len(lens), max_len)
            model(pre, c, logits="none")
            c.rollback(lens)
            caches.append(c)
    return caches


def assert_same_writes(a, b, T):
    for row, L in enumerate(a.host_lengths):
        torch.testing.assert_close(b.k[:, row, :, :L + T], a.k[:, row, :, :L + T], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(b.v[:, row, :, :L + T], a.v[:, row, :, :L + T], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "triton"])
@pytest.mark.parametrize("tree", [True, False])
def test_static_forward_equals_dynamic(backend, tree):
    if backend == "triton":
        pytest.importorskip("triton", reason=NO_TRITON)
    model = tiny_model(seed=2, backend=backend)
    dyn, sta = two_caches(model, [5, 9])
    T = len(TREE) if tree else 3
    ids = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(1))
    pos = dyn.lengths[:, None] + (TREE.depth[None] if tree else torch.arange(T))
    kw = dict(position_ids=pos, tree_mask=TREE.mask()) if tree else {}
    with torch.inference_mode():
        want = model(ids, dyn, **kw)
        with count_ops() as c:
            got = model(ids, sta, for_compile=True, **kw)
    assert c.host_reads == 0
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=1e-5)
    assert_same_writes(dyn, sta, T)
    assert sta.host_lengths == [5, 9] and sta.lengths.tolist() == [5, 9]  # a forward never moves the length


@pytest.mark.slow
def test_compiled_static_forward_equals_eager():
    """fullgraph, dynamic=False: one graph per T, replayed for new lengths; fp32 matches eager tightly."""
    from treedec.models.compile import compile_forward

    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()  # other tests' compiles count there too

    model = tiny_model(seed=3)  # 2 layers, hidden 64
    fn = compile_forward(model)
    gen = torch.Generator().manual_seed(2)
    compile_s = {}
    for T, mask in [(len(TREE), TREE.mask()), (1, None)]:
        for lens in ([5, 9], [11, 6]):  # the second call replays the graph with other ragged lengths
            dyn, sta = two_caches(model, lens)
            ids = torch.randint(0, 97, (2, T), generator=gen)
            pos = dyn.lengths[:, None] + (TREE.depth[None] if mask is not None else torch.arange(T))
            with torch.inference_mode():
                want = model(ids, dyn, position_ids=pos, tree_mask=mask).logits
                t0 = time.perf_counter()
                got = fn(ids, sta, pos, mask).logits
                compile_s.setdefault(T, time.perf_counter() - t0)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert_same_writes(dyn, sta, T)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    print(f"compile time: {compile_s}")
