"""Per-row budgets in a batch: poor rows get smaller trees, padding nodes never change the output."""
from __future__ import annotations


import pytest
import torch

from treedec.decoding.speculative import SpeculativeDecoder
from treedec.tree.policies import DynamicPolicy

from tests.decoding.test_policies import primed_drafter
from tests.helpers import OraclePolicy, greedy_reference, make_pair


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


@pytest.mark.parametrize("seed", range(4))
def test_padding_never_changes_greedy_output_on_ragged_batches(seed):
    """fp32 greedy, per row, equals plain decoding; the oracle plants the right token on padding nodes too,
    so a padding node that were ever accepted would show."""
    target, draft = make_pair(seed + 50)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 13, 8)[: 2 + seed % 2]]
    n = 40
    refs = [greedy_reference(target, p, n) for p in prompts]
    inner = DynamicPolicy(16, depth=4, top_k=3, node_share=0.5)
    pol = OraclePolicy(inner, refs, seed=seed)
    pads = []

    def hook(step):
        if step.tree is None or step.tree.pad is None:
            return
        on = torch.zeros_like(step.tree.pad)
        for b in range(on.shape[0]):
            on[b, step.path[b, : step.n_accept[b]]] = True
        pads.append(int(step.tree.pad.sum()))
        assert not (on & step.tree.pad).any()

    out = SpeculativeDecoder(target, draft, pol, eos_ids=[]).generate(prompts, n, stream=pol.stream, hook=hook)
    assert out.tokens == refs
    assert sum(pads) > 0 and out.stats.tau > 1.2  # padding was there, and long paths were accepted
