"""Runs the draft head over the verified prefix and over a growing draft tree.

The draft cache holds one entry per verified position t: the pair (target feature f_t,
token x_{t+1}). The "root" of the next tree is the newest verified token; the draft output
at the last committed position gives the root's children (``root_logp``) and the feature
they read (``root_feat``). While a tree is drafted, its nodes are written after the
committed prefix and hidden from one another except along ancestry; committing a step
discards them and appends the accepted path with the target's true features (as EAGLE does).
"""
from __future__ import annotations

import torch

from treedec.attention import prefix_tree_mask
from treedec.models.draft import DraftHead
from treedec.tree.layout import ancestor_matrix


class Drafter:
    def __init__(self, head: DraftHead, batch: int, max_len: int):
        self.head = head
        self.cache = head.new_cache(batch, max_len)
        self.root_feat: torch.Tensor | None = None  # [B, H]
        self.root_logp: torch.Tensor | None = None  # [B, V]
        self.root_tokens: torch.Tensor | None = None  # [B]

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def device(self) -> torch.device:
        return self.cache.k.device

    @property
    def vocab_size(self) -> int:
        return self.head.config.vocab_size

    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor, n_valid: torch.Tensor, root_tokens: torch.Tensor) -> None:
        """Append pairs (features[:, i], tokens[:, i]) for i < n_valid[b] and set the next root.

        ``tokens`` are one step ahead of ``features``; its last valid entry per row is the new root.
        """
        L = self.cache.lengths
        pos = L[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        feat, logits = self.head(tokens, features, self.cache, pos)
        last = (n_valid - 1).clamp(min=0)
        rows = torch.arange(self.batch, device=tokens.device)
        self.root_feat = feat[rows, last]
        self.root_logp = torch.log_softmax(logits[rows, last].float(), dim=-1)
        self.root_tokens = root_tokens
        self.cache.advance(n_valid)

    def expand(self, tokens: torch.Tensor, parent_feats: torch.Tensor, depth: int,
               forest_parents, n_prev: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft on n tree nodes of one depth at once -> (features [B, n, H], log-probs [B, n, V]).

        ``forest_parents`` [B, n_prev + n] (or a list shared by all rows) gives, for every drafted
        input so far, the input index of its parent (-1 for children of the root).
        """
        B, n = tokens.shape
        fp = torch.as_tensor(forest_parents, dtype=torch.long, device=tokens.device)
        if fp.dim() == 1:
            fp = fp[None].expand(B, -1)
        anc = ancestor_matrix(fp)[:, n_prev:]  # [B, n, n_prev + n]
        L = self.cache.lengths.clone()
        self.cache.lengths += n_prev  # new nodes go after the ones drafted before them
        try:
            mask = prefix_tree_mask(anc, L, int(L.max()) + n_prev + n)[:, None]
            pos = (L - 1 + depth)[:, None].expand(B, n)
            feat, logits = self.head(tokens, parent_feats, self.cache, pos, mask)
        finally:
            self.cache.lengths.copy_(L)
        return feat, torch.log_softmax(logits.float(), dim=-1)
