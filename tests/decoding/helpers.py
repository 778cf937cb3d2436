"""Small random targets and draft heads, a plain greedy reference, and an oracle policy wrapper."""
from __future__ import annotations

import torch

from treedec.models import LlamaConfig, Transformer
from treedec.models.draft import DraftConfig, DraftHead
from treedec.tree import Tree
from treedec.tree.policies.base import TreePolicy


def make_pair(seed: int = 0, vocab: int = 64, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
              backend: str = "sdpa", ctx: int = 1024, peaked: float = 1.0):
    """A random target and a random (untrained) draft head bound to it."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=ctx)
    target = Transformer(cfg, backend).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(peaked)
    draft = DraftHead(DraftConfig.for_target(cfg)).eval().bind(target)
    return target, draft


@torch.inference_mode()
def greedy_reference(target: Transformer, prompt: list[int], n: int) -> list[int]:
    """Plain left-to-right greedy decoding, one token per forward."""
    cache = target.new_cache(1, len(prompt) + n + 1)
    logits = target(torch.tensor([prompt]), cache, logits="last").logits
    cache.advance(len(prompt))
    out = []
    for _ in range(n):
        t = int(logits[0, -1].argmax())
        out.append(t)
        logits = target(torch.tensor([[t]]), cache).logits
        cache.advance(1)
    return out


class OraclePolicy(TreePolicy):
    """Wraps a policy and, with probability ``p_hit``, rewrites a node on the target's own greedy path
    to the correct token, so that long paths get accepted. Verification must stay lossless for any
    draft tokens, so this exercises deep accepts, commits and catch-ups that a random draft never reaches."""

    def __init__(self, inner: TreePolicy, references: list[list[int]], p_hit: float = 0.8, seed: int = 0):
        self.inner, self.refs, self.p_hit = inner, references, p_hit
        self.max_depth, self.max_size, self.max_inputs = inner.max_depth, inner.max_size, inner.max_inputs
        self.max_rank = inner.max_rank
        self.emitted = [0] * len(references)  # updated by the stream callback
        self.rng = torch.Generator().manual_seed(seed)

    def stream(self, row: int, toks: list[int]) -> None:
        self.emitted[row] += len(toks)

    def draft(self, drafter, params=None, generator=None) -> Tree:
        tree = self.inner.draft(drafter, params, generator)
        tokens = tree.tokens.clone()
        for b, ref in enumerate(self.refs):
            base = self.emitted[b] - 1  # index in ref of the root token
            good = {0}
            for c in range(1, tree.size):
                p, d = int(tree.parents[b, c]), int(tree.depth[b, c])
                if p in good and base + d < len(ref) and float(torch.rand((), generator=self.rng)) < self.p_hit:
                    tokens[b, c] = ref[base + d]
                    good.add(c)
        return tree.with_tokens(tokens)
