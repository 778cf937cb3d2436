"""Runs the draft head over the verified prefix and over a growing draft tree.

The draft cache holds one entry per verified position t: the pair (target feature f_t,
token x_{t+1}), the feature in the head's input space (``head.project``: EAGLE-3 fuses its
three layer inputs there; inside a tree every head reads its own outputs). The "root" of the
next tree is the newest verified token; the draft output at the last committed position gives
the root's children (``root_logits``) and the feature they read (``root_feat``). While a tree
is drafted, its nodes are written after the committed prefix and hidden from one another
except along ancestry; committing a step discards them and appends the accepted path with the
target's true features (as EAGLE does).

Catch-up is lazy: :meth:`Drafter.catch_up` only records the accepted pairs, and the head runs
over everything recorded, in one forward, when the root's feature or logits are first read
(before a real tree is drafted). A run of k plain decoding steps (the root alone, no draft)
then costs one head forward over k tokens instead of k forwards; the draft cache ends up the
same as if every step had caught up at once.

Nothing here reads the device: cache sizes come from the cache's host mirror, pending counts
are host lists, and policies hand over the ancestry of the nodes they expand.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from treedec.attention import prefix_tree_mask
from treedec.heads import DraftHead
from treedec.tree.policies.base import topk_logp


class _Pending(NamedTuple):
    """Accepted pairs not yet run through the head: row b holds the first ``n_host[b]`` columns."""

    tokens: torch.Tensor  # [B, w]
    features: torch.Tensor  # [B, w, F] the target's
    n_valid: torch.Tensor | None  # [B] n_host on the device, when the caller has it
    n_host: list[int]


class Drafter:
    """The draft head's state over one batch: its cache, the next root, and the catch-up still pending."""

    # Pending catch-up columns that force a head forward at once: bounds how far past a row's own
    # length a catch-up writes (padding up to the longest row; the decoder sizes the draft cache
    # with this slack), at one head forward per this many plain steps.
    MAX_PENDING = 32

    def __init__(self, head: DraftHead, batch: int, max_len: int):
        self.head = head
        self.cache = head.new_cache(batch, max_len)
        self.root_tokens: torch.Tensor | None = None  # [B]
        self._pending: list[_Pending] = []
        self._feat: torch.Tensor | None = None  # [B, H]
        self._logits: torch.Tensor | None = None  # [B, K] over the draft vocabulary (model dtype)

    @property
    def batch(self) -> int:
        return self.cache.batch

    @property
    def device(self) -> torch.device:
        return self.cache.k.device

    @property
    def vocab_size(self) -> int:
        return self.head.config.vocab_size

    @property
    def root_feat(self) -> torch.Tensor:
        """[B, H] the draft's feature at the root (runs the pending catch-up)."""
        self.flush()
        return self._feat

    @property
    def root_logits(self) -> torch.Tensor:
        """[B, K] the draft logits of the root's children (runs the pending catch-up)."""
        self.flush()
        return self._logits

    @property
    def pending(self) -> int:
        """Catch-up columns recorded and not yet run through the head."""
        return sum(p.tokens.shape[1] for p in self._pending)

    def catch_up(self, tokens: torch.Tensor, features: torch.Tensor, n_valid: torch.Tensor | None,
                 n_host: Sequence[int], root_tokens: torch.Tensor) -> None:
        """Record pairs (features[:, i], tokens[:, i]) for i < n_host[b] and set the next root.

        ``features`` are the target's (``head.features`` of its forward); ``tokens`` are one step
        ahead of them, and their last valid entry per row is the new root. ``n_host`` says how many
        are valid per row, on the host (the caller already read it); ``n_valid`` is its device copy
        if the caller has one (else None). The head runs on first use of ``root_feat`` /
        ``root_logits`` (or at once when :data:`MAX_PENDING` columns wait); until then :attr:`cache`
        lags behind by what is pending (:meth:`flush` brings it up to date).
        """
        n_host = [int(x) for x in n_host]
        w = max(n_host, default=0)
        self.root_tokens = root_tokens
        if w == 0:  # no row keeps anything: nothing to run, the root state stays
            return
        if w < tokens.shape[1]:  # columns no row keeps need no forward
            tokens, features = tokens[:, :w], features[:, :w]
        self._pending.append(_Pending(tokens, features, n_valid, n_host))
        self._feat = self._logits = None
        if self.pending >= self.MAX_PENDING:
            self.flush()

    def flush(self) -> None:
        """Run the head over every recorded pair at once, appending them to the draft cache."""
        if self._pending:
            self._run_pending()

    def _take_pending(self) -> tuple[_Pending, torch.Tensor, torch.Tensor]:
        """The recorded catch-up as one chunk, taken: (chunk, its valid counts on the device, its positions [B, w])."""
        p = self._pending[0] if len(self._pending) == 1 else self._pack(self._pending)
        self._pending = []
        dev = p.tokens.device
        n_valid = p.n_valid if p.n_valid is not None else torch.tensor(p.n_host).to(dev, non_blocking=True)
        return p, n_valid, self.cache.lengths[:, None] + torch.arange(p.tokens.shape[1], device=dev)

    @torch.inference_mode()  # so that state read after ``generate`` (tests, tools) catches up too
    def _run_pending(self, n_mask: int = 0) -> torch.Tensor | None:
        """The catch-up; with ``n_mask`` (a one-pass head) the step's mask positions after it, in the same forward:
        returns their outputs [B, n_mask, H] (None without). A context-only head (DFlash) only writes the context."""
        p, n_valid, pos = self._take_pending()
        tokens, n_host, w = p.tokens, p.n_host, p.tokens.shape[1]
        if self.head.context_only:
            self.head.forward_block(None, self.head.project(p.features), 0, self.cache, pos, None)
            self.cache.advance(n_host)
            return None
        if n_mask:
            out = self.head.forward_block(tokens, self.head.project(p.features), n_mask, self.cache,
                                          *self._block_layout(pos, n_valid, n_host, n_mask))
            feat, masked = out[:, :w], out[:, w:]
        else:
            feat, masked = self.head(tokens, self.head.project(p.features), self.cache, pos), None
        self._feat = feat[torch.arange(self.batch, device=pos.device), (n_valid - 1).clamp(min=0)]
        self._logits = self.head.logits(self._feat)
        self.cache.advance(n_host)
        return masked

    @torch.inference_mode()
    def _block_marginals(self, depth: int) -> torch.Tensor:
        """A context-only head's (DFlash's) draft logits [B, depth, K]: the pending context written and the block (the
        root, then the head's ``block_size`` mask positions: within a non-causal block every position reads every
        other, so the block always has the length it was trained at) run in one head pass; its first ``depth``
        marginals are returned and its keys dropped with the tree."""
        cache, root, n = self.cache, self.root_tokens, self.head.block_size  # n: the whole block's depths
        host = list(cache.host_lengths)
        if self._pending:
            p, n_valid, pos = self._take_pending()
            ctx, w, n_host = self.head.project(p.features), p.tokens.shape[1], p.n_host
        else:
            ctx, w, n_host = None, 0, None
        if min(host) == max(host) and (ctx is None or min(n_host) == w):  # rows of one length, no padding: the
            #                                        block sees every key (batch 1 always): no mask to build
            pos = torch.arange(host[0], host[0] + w + n + 1, device=self.device).expand(self.batch, -1)
            mask = "full"
        else:
            if ctx is None:
                pos, n_valid = cache.lengths[:, None][:, :0], torch.zeros_like(cache.lengths)
                n_host = [0] * self.batch
            pos, mask = self._block_layout(pos, n_valid, n_host, n + 1, causal=False)
            mask = mask[:, :, w:]  # the block's rows: context positions ask nothing
        out = self.head.forward_block(root, ctx, n, cache, pos, mask)
        if ctx is not None:
            cache.advance(n_host)
        return self.head.logits(out[:, :depth])

    def _block_layout(self, pos: torch.Tensor, n_valid: torch.Tensor, n_host: list[int], n: int,
                      causal: bool = True):
        """(positions [B, w + n], dense mask) of a catch-up of ``w`` columns followed by ``n`` block positions: row b's
        block positions sit at RoPE positions after its ``n_host[b]`` valid columns and see those, not its padding;
        within the block causally, or (``causal=False``, DFlash) every block position sees the whole block."""
        w, dev = pos.shape[1], pos.device
        j = torch.arange(n, device=dev)
        pos = torch.cat([pos, (self.cache.lengths + n_valid)[:, None] + j], 1)
        cols = torch.arange(w + n, device=dev)
        see = cols[None, :] <= cols[:, None]  # [w + n, w + n]
        if not causal:
            see = see | ((cols[None, :] >= w) & (cols[:, None] >= w))
        real_ok = (cols[None, None, :] < n_valid[:, None, None]) | (cols[None, None, :] >= w)  # [B, 1, w + n]
        anc = see[None] & (real_ok | (cols[None, :, None] < w))  # real columns: plain causal
        host = list(self.cache.host_lengths)
        return pos, prefix_tree_mask(anc, self.cache.lengths, max(host) + w + n, host_lens=host)[:, None]

    @staticmethod
    def _pack(chunks: list[_Pending]) -> _Pending:
        """Several recorded catch-ups -> one: each row's valid columns in order, padding after them.

        Chunks are concatenated; when an earlier chunk holds padding in some row, one index (built on
        the host from the counts) moves every row's valid columns to the front.
        """
        tokens = torch.cat([c.tokens for c in chunks], 1)
        features = torch.cat([c.features for c in chunks], 1)
        n_host = [sum(c) for c in zip(*(c.n_host for c in chunks))]
        if all(min(c.n_host) == c.tokens.shape[1] for c in chunks[:-1]):
            return _Pending(tokens, features, None, n_host)  # padding only at the end of each row
        offsets, at = [], 0
        for c in chunks:
            offsets.append(at)
            at += c.tokens.shape[1]
        W = max(n_host)
        idx = []
        for b in range(len(n_host)):
            cols = [o + i for o, c in zip(offsets, chunks) for i in range(c.n_host[b])]
            idx.append(cols + [cols[-1] if cols else 0] * (W - len(cols)))
        idx = torch.tensor(idx).to(tokens.device, non_blocking=True)
        rows = torch.arange(len(n_host), device=tokens.device)[:, None]
        return _Pending(tokens[rows, idx], features[rows, idx], None, n_host)

    def keep_rows(self, idx: torch.Tensor, rows: Sequence[int]) -> None:
        """Keep only batch rows ``rows`` (``idx``, their device copy) of the root state and the pending
        catch-up; the caller cuts :attr:`cache` to the same rows."""
        pick = lambda t: None if t is None else t.index_select(0, idx)
        self._pending = [_Pending(pick(p.tokens), pick(p.features), pick(p.n_valid), [p.n_host[r] for r in rows])
                         for p in self._pending]
        self.root_tokens, self._feat, self._logits = pick(self.root_tokens), pick(self._feat), pick(self._logits)

    def put_rows(self, slots: Sequence[int], other: "Drafter") -> None:
        """Load ``other``'s rows (new prompts, prefilled) into batch slots ``slots``: draft cache, root token, feature
        and logits. Both catch up first, so no pending pair is left to split between batches."""
        self.flush()
        other.flush()
        self.cache.put_rows(slots, other.cache)
        idx = torch.tensor([int(s) for s in slots], device=self.device)

        def put(mine: torch.Tensor | None, theirs: torch.Tensor | None) -> torch.Tensor | None:
            if mine is None:  # (a context-only head keeps no root feature or logits)
                return None
            out = mine.clone()  # (the old tensor may be another object's, e.g. the last step's bonus tokens)
            out[idx] = theirs.to(out.dtype)
            return out

        self.root_tokens = put(self.root_tokens, other.root_tokens)
        self._feat, self._logits = put(self._feat, other._feat), put(self._logits, other._logits)

    @property
    def one_pass(self) -> bool:
        """The head drafts per-position marginals in one pass (:meth:`marginals`), not a node at a time (:meth:`expand`)."""
        return self.head.one_pass

    def marginals(self, depth: int) -> torch.Tensor:
        """A one-pass head's draft logits [B, depth, K] of depths 1..``depth`` below the root: depth 1 is
        :attr:`root_logits`; depths 2.. come from one head pass over ``depth - 1`` mask positions after each row's
        prefix (:meth:`~treedec.heads.parallel.ParallelHead.forward_mask`), each the distribution of the token that
        far ahead whatever the drafts before it; with a catch-up pending, that catch-up and the mask positions run
        as one forward. Their keys are written past the prefix and dropped with the tree."""
        if self.head.context_only:
            if depth > self.head.block_size:
                raise ValueError(f"this DFlash drafter drafts {self.head.block_size} depths per pass; asked for {depth}")
            return self._block_marginals(depth)
        n, cache = depth - 1, self.cache
        if n >= self.head.block_size:
            raise ValueError(f"this parallel head drafts {self.head.block_size} positions per pass; asked for {depth}")
        if n and self._pending:  # the catch-up and the mask positions in one head pass
            masked = self._run_pending(n)
            return torch.cat([self._logits[:, None], self.head.logits(masked).to(self._logits.dtype)], 1)
        first = self.root_logits[:, None]
        if depth <= 1:
            return first
        host = list(cache.host_lengths)
        if min(host) == max(host):
            pos = torch.arange(host[0], host[0] + n, device=self.device).expand(self.batch, n)
        else:
            pos = cache.lengths[:, None] + torch.arange(n, device=self.device)
        feat = self.head.forward_mask(n, cache, pos)
        return torch.cat([first, self.head.logits(feat).to(first.dtype)], 1)

    def root_topk(self, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [B, k], target token ids [B, k]) of the root's k most likely children."""
        return self.topk(self.root_logits, k, temperature)

    def topk(self, logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs at ``temperature``, target token ids) of the k most likely draft tokens of ``logits`` [..., K]."""
        logp, idx = topk_logp(logits, k, temperature)
        return logp, self.head.to_target_ids(idx)

    def expand_one(self, tokens: torch.Tensor, parent_feats: torch.Tensor, depth: int,
                   n_prev: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """:meth:`expand` of one node per row that sees every earlier input (a chain's next node), tokens [B] and
        parent_feats [B, H] -> (features [B, H], logits [B, V]) through the head's lean one-node pass
        (:meth:`DraftHead.forward_one`); None for a head without one."""
        self.flush()
        feat = self.head.forward_one(tokens, parent_feats, self.cache, n_prev, depth - 1)
        return None if feat is None else (feat, self.head.logits(feat))

    def expand(self, tokens: torch.Tensor, parent_feats: torch.Tensor, depth: int,
               anc_rows: torch.Tensor | None, n_prev: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the draft on n tree nodes of one depth at once -> (features [B, n, H], logits [B, n, V]).

        ``anc_rows`` [(B,) n, n_prev + n] (bool): which of the inputs drafted so far in this
        tree (the ``n_prev`` earlier ones, then these n) each new node may see: itself and
        its ancestors; None: one node (n = 1) that sees them all (a chain). The new nodes are
        written after the ones drafted before them.
        """
        B, n = tokens.shape
        if anc_rows is None and n != 1:
            raise ValueError(f"anc_rows=None means one node that sees every earlier input; got {n} nodes")
        if anc_rows is None:  # a chain's node: the head's lean one-node pass
            out = self.expand_one(tokens[:, 0], parent_feats[:, 0], depth, n_prev)
            if out is not None:
                return out[0][:, None], out[1][:, None]
        self.flush()
        cache = self.cache
        host = list(cache.host_lengths)
        uniform = min(host) == max(host)  # rows of one length: host-built positions and mask, fewer ops
        if anc_rows is None and uniform:
            mask = "full"  # one query seeing every key: attention needs no mask
        elif anc_rows is None:  # a chain's node over ragged rows sees its row's prefix and every node before it
            keys = torch.arange(max(host) + n_prev + 1, device=tokens.device)
            mask = (keys < (cache.lengths + (n_prev + 1))[:, None])[:, None, None]
        else:
            mask = prefix_tree_mask(anc_rows, cache.lengths, max(host) + n_prev + n, host_lens=host)[:, None]
        if uniform:
            pos = torch.full((B, n), host[0] - 1 + depth, dtype=torch.long, device=tokens.device)
        else:
            pos = (cache.lengths - 1 + depth)[:, None].expand(B, n)
        if n_prev:
            cache.advance(n_prev)
        try:
            feat = self.head(tokens, parent_feats, cache, pos, mask)
        finally:
            cache.rollback(host[0] if uniform else host)
        return feat, self.head.logits(feat)
