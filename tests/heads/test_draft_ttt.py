"""EAGLE-1/2 training-time test (DraftHead.forward_unrolled): step i is what drafting at depth i computes."""
import pytest
import torch

from treedec.decoding.drafter import Drafter
from treedec.heads import DraftConfig, build_head
from treedec.models import LlamaConfig, Transformer


def pair(seed: int, vocab: int = 50):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    target = Transformer(cfg, "sdpa").eval()
    head = build_head(DraftConfig.for_target(cfg, kind="eagle", rope_theta=5000.0))
    with torch.no_grad():  # norms away from 1, so a wrong norm shows
        for n, p in head.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return target, head.eval().bind(target)


@pytest.mark.parametrize("seed", range(4))
def test_unrolled_steps_equal_drafting_the_true_continuation(seed):
    target, head = pair(seed)
    S, steps = 14, 4
    ids = torch.randint(0, 50, (1, S))
    with torch.no_grad():
        _, feats = target.forward_train(ids, return_hidden=True)
        unrolled = head.forward_unrolled(ids[:, 1:], feats[:, :-1], steps)
        feat0, logits0 = head.forward_train(ids[:, 1:], feats[:, :-1])
    torch.testing.assert_close(unrolled[0][0], feat0)  # step 0 is the one-step pass
    torch.testing.assert_close(unrolled[0][1], logits0)
    for n in (4, 7):  # the verified prefix x_0..x_n; root token x_n
        d = Drafter(head, 1, 32)
        d.catch_up(ids[:, 1:n + 1], feats[:, :n], torch.tensor([n]), [n], ids[:, n])
        torch.testing.assert_close(d.root_logits[0], unrolled[0][1][0, n - 1], atol=1e-5, rtol=1e-5)
        parent, n_prev = d.root_feat[:, None], 0
        for depth in range(1, steps):
            anc = torch.ones(1, n_prev + 1, dtype=torch.bool)  # a chain: every earlier node is an ancestor
            feat, logits = d.expand(ids[:, n + depth: n + depth + 1], parent, depth, anc, n_prev)
            torch.testing.assert_close(logits[0, 0], unrolled[depth][1][0, n - 1 + depth], atol=1e-5, rtol=1e-5)
            parent, n_prev = feat, n_prev + 1

