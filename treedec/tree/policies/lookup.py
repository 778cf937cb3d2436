"""Prompt lookup inside a tree: a chain copied from the context, verified beside the draft's tree.

Code repeats itself (names, call patterns, whole lines), and ``transformers``' prompt lookup
drafts by copying what followed the last occurrence of the current n-gram. Here that copy is one
more branch under the root of any policy's tree: it costs no draft-head pass, only its tokens in
the verify, and the acceptance walk keeps whichever path the target accepts furthest (the draft's
or the copy's). Greedy only: under sampling a copy that repeats a drafted sibling would let the walk
pick between two independent draws of the same token, so sampled steps keep the inner tree alone.

The context is the verified sequence of each row (its prompt, then every accepted token), kept on
the host from what the decoder already reads each step (:meth:`TreePolicy.begin` / ``observe``), so
the lookup adds no device read. An incremental index maps each n-gram to where it last ended.
The merged tree records the inner tree's size (``Tree.inner_size``), so the decoder also reports what
the inner nodes alone accepted, in the step's one read; the inner policy learns from that (tree=auto
would otherwise credit the copy's tokens to its own trees).

When the copy outran the draft (every row accepted more copied tokens than the inner tree is deep), the next
step verifies the copy alone: a repeated block is being copied, and the draft head's passes (a third of a
step at batch 1) would buy nothing. The head catches up lazily, in one pass, on the next drafted step.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from treedec.conf_defaults import shipped_defaults
from treedec.sampling import SamplingParams
from treedec.tree.policies.base import TreePolicy
from treedec.tree.tree import Tree, TreeError

_D = shipped_defaults("tree/lookup")  # the defaults of tree=lookup, written once there


class NgramIndex:
    """One row's verified tokens and, for each n in ``sizes``, the last position where each n-gram ended.

    The n-grams ending at the newest token are indexed only once a later token arrives, so a lookup of
    the current suffix finds its latest *earlier* occurrence, never itself.
    """

    def __init__(self, tokens: Sequence[int], sizes: Sequence[int]):
        self.tokens: list[int] = []
        self.sizes = tuple(sizes)
        self.last: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, new: Sequence[int]) -> None:
        toks = self.tokens
        start = max(len(toks) - 1, 0)  # the old newest token's n-grams are indexed now
        toks.extend(int(t) for t in new)
        for end in range(start, len(toks) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.last[tuple(toks[end + 1 - n: end + 1])] = end

    def propose(self, max_tokens: int) -> list[int]:
        """What followed the latest earlier occurrence of the longest suffix n-gram found (up to ``max_tokens``)."""
        toks = self.tokens
        for n in self.sizes:  # longest first
            if len(toks) > n:
                end = self.last.get(tuple(toks[-n:]))
                if end is not None:
                    return toks[end + 1: end + 1 + max_tokens]
        return []


class LookupPolicy(TreePolicy):
    """``inner``'s tree plus, under the root, a chain of up to ``tokens`` tokens copied from the context.

    ``ngram``: the n-gram sizes tried, longest first (the copy follows the latest earlier occurrence of
    the context's last n tokens). Rows whose copy is shorter than the batch's longest are filled with
    padding nodes (never accepted). ``max_rows``: copies are added while the batch holds at most this many
    rows (every row verifies the longest copy's width, and at 16 rows this CPU's target is compute-bound: the
    copy cost more than it returned there, docs/benchmarks.md); a compacted batch's last rows get them again.
    ``skip_draft``: a step after one where every row's copy outran the inner tree (accepted more drafts than it is
    deep) verifies the copies alone, with no draft-head pass. Lossless either way: only which tokens are verified
    changes.
    """

    def __init__(self, inner: TreePolicy, tokens: int = _D["tokens"], ngram: Sequence[int] = _D["ngram"],
                 max_rows: int = _D["max_rows"], skip_draft: bool = _D["skip_draft"]):
        sizes = sorted({int(n) for n in ngram}, reverse=True)
        if int(tokens) < 1 or not sizes or sizes[-1] < 1 or int(max_rows) < 1:
            raise TreeError(f"lookup needs tokens >= 1, n-gram sizes >= 1 and max_rows >= 1, got tokens={tokens}, "
                            f"ngram={list(ngram)}, max_rows={max_rows}")
        self.inner, self.tokens, self.sizes, self.max_rows = inner, int(tokens), sizes, int(max_rows)
        self.skip_draft = bool(skip_draft)
        self.widths = sorted({1 << i for i in range(self.tokens.bit_length()) if 1 << i < self.tokens} | {self.tokens})
        self.max_depth = max(inner.max_depth, self.tokens)
        self.max_size = inner.max_size + self.tokens
        self.max_inputs, self.max_rank = inner.max_inputs, inner.max_rank
        self.rows: list[NgramIndex] = []
        self.active: list[bool] = []  # rows still decoding (a finished row of an uncompacted batch gets no copy)
        self.outran: list[bool] = []  # rows whose last step accepted more copied tokens than the inner tree is deep
        self._skipped = False  # the step now running verifies the copies alone (the inner policy drafted nothing)
        self._inner_size = 1  # the last inner tree's size (host): a copy-alone step pads its root up to it
        self.steps = self.skipped_steps = 0  # steps drafted and those among them that verified the copies alone
        self._blocks: dict = {}

    @property
    def reads(self) -> str:
        return self.inner.reads

    def check_head(self, head) -> None:
        self.inner.check_head(head)

    def prepare(self, target, head, rows: int, context: int, new_drafter, compiled: bool = False) -> None:
        self.inner.prepare(target, head, rows, context, new_drafter, compiled)

    @property
    def history(self) -> list | None:
        """The inner policy's chosen shapes, if it sizes its trees (the bench reports them)."""
        return getattr(self.inner, "history", None)

    def validate(self, vocab_size: int) -> None:
        self.inner.validate(vocab_size)

    def begin(self, prompts: Sequence[Sequence[int]], first: Sequence[int]) -> None:
        self.rows = [NgramIndex([*p, t], self.sizes) for p, t in zip(prompts, first)]
        self.active = [True] * len(self.rows)
        self.outran = [False] * len(self.rows)
        self._skipped, self._inner_size = False, 1
        self.inner.begin(prompts, first)

    def admit(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], first: Sequence[int]) -> None:
        for j, p, t in zip(slots, prompts, first):
            self.rows[j], self.active[j], self.outran[j] = NgramIndex([*p, t], self.sizes), True, False
        self.inner.admit(slots, prompts, first)

    def keep_rows(self, order: Sequence[int]) -> None:
        self.rows, self.active = [self.rows[i] for i in order], [self.active[i] for i in order]
        self.outran = [self.outran[i] for i in order]
        self.inner.keep_rows(order)

    def observe(self, info) -> None:
        for row, toks, on in zip(self.rows, info.tokens, info.active):
            if on and toks:
                row.extend(toks)
        self.active = list(info.active)
        # n_accept counts the root: more than max_depth drafts accepted is only possible along the copy
        self.outran = [on and n - 1 > self.inner.max_depth for n, on in zip(info.n_accept, info.active)]
        if self._skipped:
            return  # the inner policy drafted nothing this step: nothing of it to learn
        if info.inner_n_accept is not None:  # the inner policy learns from what its own nodes accepted
            info = replace(info, n_accept=info.inner_n_accept)
        self.inner.observe(info)

    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Tree:
        self.steps += 1
        copies = None  # none under sampling (module docstring) or for a batch wider than max_rows
        if (params is None or params.greedy) and len(self.rows) <= self.max_rows:
            copies = [r.propose(self.tokens) if on else [] for r, on in zip(self.rows, self.active)]
        self._skipped = (copies is not None and self.skip_draft and any(self.active)
                         and all(o and c for o, c, on in zip(self.outran, copies, self.active) if on))
        if self._skipped:
            self.skipped_steps += 1
            # the roots padded to the last inner tree's size: the same verify shape as the step before (compile=True
            # builds no graph for it, oneDNN no primitive; the head passes saved cost ~10x those tokens)
            return self._merge(Tree.root_only(drafter.root_tokens, self._inner_size), copies, self._width(copies))
        tree = self.inner.draft(drafter, params, generator)
        self._inner_size = tree.size
        if tree.size == 1 or tree.draft_probs is not None or not copies or not any(copies):
            return tree  # a plain step stays one; a sampled tree is verified alone
        if len(copies) != tree.tokens.shape[0]:
            return tree  # no context: drafted outside a decoder's generate, which calls begin
        return self._merge(tree, copies, self._width(copies))

    def _width(self, copies: list[list[int]]) -> int:
        """The longest copy's width in a few buckets (1, 2, 4, 8, ..., tokens), padded: few verify shapes, so
        compile=True builds few graphs (and oneDNN few primitives), as tree=auto's T sizes do."""
        longest = max(map(len, copies))
        return next(w for w in self.widths if w >= longest)

    def _merge(self, tree: Tree, copies: list[list[int]], L: int) -> Tree:
        """``tree`` [B, T] with each row's copy as a chain under the root in slots T..T+L-1 (padding after it)."""
        B, T = tree.tokens.shape
        dev = tree.tokens.device
        if (T, L) not in self._blocks:  # a full copy's parents, depths and ancestry rows
            anc = torch.zeros(L, T + L, dtype=torch.bool)
            anc[:, 0] = True
            anc[:, T:] = torch.ones(L, L, dtype=torch.bool).tril()
            alone = torch.zeros(L, T + L, dtype=torch.bool)
            alone[:, T:] = torch.eye(L, dtype=torch.bool)
            self._blocks[T, L] = (torch.tensor([0, *range(T, T + L - 1)]), torch.arange(1, L + 1), anc, alone)
        par, dep, anc_full, anc_pad = self._blocks[T, L]
        toks = torch.tensor([c + [0] * (L - len(c)) for c in copies])
        par, dep, anc = par.expand(B, L), dep.expand(B, L), anc_full.expand(B, L, T + L)
        pad = None
        if min(map(len, copies)) < L:  # a row with no copy, a shorter one, or one padded up to the width bucket
            pad = torch.tensor([[j >= len(c) for j in range(L)] for c in copies])
            par, dep = torch.where(pad, 0, par), torch.where(pad, 1, dep)  # a padding node: a leaf under the root
            anc = torch.where(pad[:, :, None], anc_pad, anc)  # that sees only itself
        to = lambda t: t.to(dev, non_blocking=True)
        A = torch.zeros(B, T + L, T + L, dtype=torch.bool, device=dev)
        A[:, :T, :T] = tree.ancestors()
        A[:, T:] = to(anc)
        z = torch.zeros(B, L, dtype=torch.long, device=dev)
        inner_pad = tree.pad if tree.pad is not None else (None if pad is None else torch.zeros(B, T, dtype=torch.bool,
                                                                                                 device=dev))
        return Tree(
            parents=torch.cat([tree.parents, to(par)], 1),
            depth=torch.cat([tree.depth.expand(B, T), to(dep)], 1),
            rank=torch.cat([tree.rank.expand(B, T), z], 1),
            tokens=torch.cat([tree.tokens, to(toks)], 1),
            scores=None if tree.scores is None else torch.cat([tree.scores, z.float()], 1),
            anc=A,
            pad=None if inner_pad is None else torch.cat([inner_pad, to(pad) if pad is not None else z.bool()], 1),
            inner_size=T,
        )
