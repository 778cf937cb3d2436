"""Runs the draft head over the verified prefix and over a growing draft tree.

The draft cache holds one entry per verified position t: the pair (target feature f_t,
token x_{t+1}), the feature in the head's input space (``head.project``: EAGLE-3 fuses its
three layer inputs there; inside a tree every head reads its own outputs). The "root" of the
next tree is the newest verified token; the draft output at the last committed position gives
the root's children (``root_logits``) and the feature they read (``root_feat``). While a tree
is drafted, its nodes are written after the committed prefix and hidden from one another
except along ancestry; committing a step discards them and appends the accepted path with the
target's true features (as EAGLE does).

Nothing here reads the device: cache sizes come from the cache's host mirror, and policies
hand over the ancestry of the nodes they expand.
"""
from __future__ import annotations

from typing import Sequence

import torch

from treedec.attention import prefix_tree_mask
from treedec.models.draft import DraftHead
from treedec.tree.policies.base import topk_logp


class Drafter:
    def __init__(self, head: DraftHead, batch: int, max_len: int):
        self.head = head
        self.cache = head.new_cache(batch, max_len)
        self.root_feat: torch.Tensor | None = None  # [B, H]
        self.root_logits: torch.Tensor | None = None  # [B, K] over the draft vocabulary (model dtype)
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

    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor, n_valid: torch.Tensor,
                 n_host: Sequence[int], root_tokens: torch.Tensor) -> None:
        """Append pairs (features[:, i], tokens[:, i]) for i < n_valid[b] and set the next root.

        ``features`` are the target's (``head.features`` of its forward); ``tokens`` are one step
        ahead of them, and their last valid entry per row is the new root. ``n_host`` is
        ``n_valid`` as a host list (the caller already read it).
        """
        L = self.cache.lengths
        pos = L[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        feat = self.head(tokens, self.head.project(features), self.cache, pos)
        last = (n_valid - 1).clamp(min=0)
        rows = torch.arange(self.batch, device=tokens.device)
        self.root_feat = feat[rows, last]
        self.root_logits = self.head.logits(self.root_feat)
        self.root_tokens = root_tokens
        self.cache.advance(n_host)

    def root_topk(self, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [B, k], target token ids [B, k]) of the root's k most likely children."""
        return self.topk(self.root_logits, k, temperature)

    def topk(self, logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs at ``temperature``, target token ids) of the k most likely draft tokens of ``logits`` [..., K]."""
        logp, idx = topk_logp(logits, k, temperature)
        return logp, self.head.to_target_ids(idx)

    def expand(self, tokens: torch.Tensor, parent_feats: torch.Tensor, depth: int,
               anc_rows: torch.Tensor, n_prev: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft on n tree nodes of one depth at once -> (features [B, n, H], logits [B, n, V]).

        ``anc_rows`` [(B,) n, n_prev + n] (bool): which of the inputs drafted so far in this
        tree (the ``n_prev`` earlier ones, then these n) each new node may see: itself and
        its ancestors. The new nodes are written after the ones drafted before them.
        """
        B, n = tokens.shape
        cache = self.cache
        L, host = cache.lengths.clone(), list(cache.host_lengths)
        cache.advance(n_prev)
        try:
            mask = prefix_tree_mask(anc_rows, L, max(host) + n_prev + n)[:, None]
            pos = (L - 1 + depth)[:, None].expand(B, n)
            feat = self.head(tokens, parent_feats, cache, pos, mask)
        finally:
            cache.rollback(host)
        return feat, self.head.logits(feat)
