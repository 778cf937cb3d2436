"""Per-row budgets in a batch: poor rows get smaller trees, drafted padding is a tail of self-seeing leaves (that
padding never changes the output: the lossless matrix's dynamic_shared cases, tests/decoding/test_lossless_greedy.py)."""
from __future__ import annotations

import pytest
import torch

from tests.decoding.test_policies import primed_drafter
from treedec.tree.policies import DynamicPolicy


def test_row_pad_gives_poor_rows_smaller_trees_under_a_global_cap():
    pol = DynamicPolicy(8, depth=4, top_k=3, node_share=0.5)
    easy = torch.log(torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]))
    poor = torch.log(torch.tensor([0.3, 0.1, 0.05, 0.01, 0.01, 0.005, 0.001]))
    pad = pol.row_pad(torch.stack([easy, poor, easy]))
    kept = (~pad).sum(1).tolist()
    assert sum(kept) == pol.kept(3, 8) == 10  # the cap: half of the batch's 3 x 7 slots
    assert kept[1] < kept[0] == kept[2]  # the hard row gets the smaller tree
    assert all(row.tolist() == sorted(row.tolist()) for row in pad.long())  # a prefix of each row's ranking


@pytest.mark.parametrize("seed", range(3))
def test_drafted_padding_is_a_tail_of_self_seeing_leaves(seed):
    pol = DynamicPolicy(16, depth=4, top_k=3, node_share=0.4)
    with torch.inference_mode():
        tree = pol.draft(primed_drafter(seed, batch=2))
    pad, anc = tree.pad, tree.ancestors()
    assert int((~pad[:, 1:]).sum()) == pol.kept(2, 16) and not pad[:, 0].any()
    for b in range(2):
        n_real = int((~pad[b]).sum())
        assert pad[b, n_real:].all()  # real nodes first, in topological order
        par = tree.parents[b, 1:n_real]
        assert (par >= 0).all() and (par < torch.arange(1, n_real)).all() and not pad[b, par].any()
        for i in range(n_real, tree.size):
            assert anc[b, i].nonzero().flatten().tolist() == [i]  # sees only itself (and the prefix)
            assert not anc[b, :, i].sum() > 1  # and nobody sees it
        assert sum(map(len, tree.children(b))) == n_real - 1
