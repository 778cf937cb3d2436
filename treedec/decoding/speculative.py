"""The speculative loop: draft a tree, verify it in one target pass, commit, advance the draft.

Per step: the policy drafts a tree rooted at the last verified token; the target scores all
T nodes in one forward with tree attention; the acceptance rule picks one path on the device;
the step's tokens are read back once (the only host read of a step); the target cache keeps
that path's K/V (``commit``, one op for all layers); the drafter records the accepted tokens
with the target's true features, and the draft head catches up on them (which also yields the
next tree's root children) only when the next real tree is drafted.

A tree of the root alone (``tree=auto`` found that no tree pays, or near the end of the
context, where a tree no longer fits) is a plain decoding step and runs as vanilla's does: a
mask-free one-token forward, the target's pick at the root, ``advance``, no draft head.
Speculative decoding accepts exactly the prompts and budgets that vanilla decoding accepts.
"""
from __future__ import annotations

import logging
import numbers
import time
from typing import Mapping, Sequence

import torch

from treedec.decoding.drafter import Drafter
from treedec.decoding.loop import Decoder
from treedec.decoding.prompt_checks import normalize_eos, pad_prompts, static_room
from treedec.decoding.stats import DecodeStats, StepInfo, Timer
from treedec.decoding.vanilla import pick
from treedec.decoding.verify import (
    Acceptance,
    accept_chain,
    accept_paths,
    acceptance_counts,
    add_chain_counts,
    emitted,
    node_choices,
    verify_sampling,
)
from treedec.errors import ConfigError
from treedec.heads import DraftHead
from treedec.models.compile import compile_forward
from treedec.models.llama import Transformer
from treedec.sampling import RowStreams, SamplingParams, as_sampling, next_token, settle
from treedec.tree.policies.base import TreePolicy
from treedec.tree.tree import Tree

log = logging.getLogger(__name__)

# Depth beyond which a tree rarely pays: acceptance falls with every level, and each level is a draft-head forward
# (EAGLE's trees are 5-8 deep); deeper ones get a warning, not an error.
SANE_DEPTH = 32
POLICY_SIZES = ("max_depth", "max_size", "max_inputs", "max_rank")  # what the decoder sizes its caches by


def check_policy(policy: TreePolicy, context_length: int) -> None:
    """Refuse a policy whose sizes are not whole numbers or whose deepest path (and root) cannot fit the model's
    context, and warn about one deeper than :data:`SANE_DEPTH`: here, where the policy meets the model, since
    only the decoder knows the context."""
    for name in POLICY_SIZES:
        value = getattr(policy, name, None)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{type(policy).__name__}.{name}={value!r} is not a whole number; give the tree "
                              f"whole numbers (tree.depth, tree.top_k, tree.total_tokens)")
    depth = int(policy.max_depth)
    if depth + 1 > context_length:
        raise ConfigError(f"tree.depth={depth}: a tree {depth} levels deep plus its root needs {depth + 1} "
                          f"positions, more than the model's context of {context_length} tokens; lower tree.depth "
                          f"(beyond {SANE_DEPTH} it rarely pays)")
    if depth > SANE_DEPTH:
        log.warning("tree.depth=%d: the tree policy drafts up to %d levels a step; a depth beyond %d rarely pays "
                    "(acceptance falls with every level, and each is a draft-head forward): lower tree.depth",
                    depth, depth, SANE_DEPTH)


class SpeculativeDecoder(Decoder):
    """Lossless tree speculative decoding of ``target`` with an EAGLE ``draft`` head and a tree ``policy``."""

    def __init__(self, target: Transformer, draft: DraftHead, policy: TreePolicy,
                 sampling: SamplingParams | Mapping | None = SamplingParams(),
                 eos_ids: Sequence[int] | int | None = None, compile: bool = False):
        """``sampling``: a :class:`SamplingParams` or a dict of its fields. ``compile``: verify with a
        ``torch.compile``d static-shape target pass (a graph per tree size and cache bucket, see
        :func:`~treedec.decoding.prompt_checks.static_room`; the draft head stays eager). The first ``generate`` of a
        bucket pays the compile time."""
        self.sampling = as_sampling(sampling)
        policy.check_head(draft)  # (a policy that sizes its trees fits its candidates to the head here)
        check_policy(policy, target.config.context_length)
        self.target, self.draft, self.policy = target, draft.bind(target), policy
        self.eos = normalize_eos(eos_ids, target.config.eos_ids)
        policy.validate(draft.config.draft_vocab_size or target.config.vocab_size)
        self.compile, self._verify, self._room = compile, None, 0

    # --------------------------------------------------------------------------------- the loop
    def _prepare(self, rows: int, context: int) -> None:
        self.policy.prepare(self.target, self.draft, rows, context,
                            lambda b, room: Drafter(self.draft.for_batch(b), b, room + Drafter.MAX_PENDING),
                            self.compile)

    def _prefill(self, rows: list[list[int]], max_new_tokens: int, generator, longest: int = 0) -> list[int]:
        tgt, pol, dev = self.target, self.policy, self.target.device
        if self.draft.target is not tgt:  # the head object was bound to another decoder's target since: take it back
            self.draft.bind(tgt)  # (one head serves several decoders, each drafting for its own target)
        B = len(rows)
        # A row's cache may run max_depth past its budget on its last step (the path is committed whole);
        # after that it is frozen, so its tree is still written (and ignored) at the same slots.
        room = max(longest, *map(len, rows)) + max_new_tokens + pol.max_depth + 2
        if self.compile:  # cache lengths in buckets that only grow, so the compiled verify compiles rarely
            room = self._room = max(static_room(room, tgt.config.context_length + pol.max_depth + 2), self._room)
            if self._verify is None:
                self._verify = compile_forward(tgt)
        self.cache = tgt.new_cache(B, room + pol.max_size)
        # the head for this batch (an fp32 head's bf16 twin drafts wide batches faster on some CPUs); admitted
        # prompts' drafters take the same one (their caches are copied into this one's)
        self.drafter = Drafter(self.draft.for_batch(B), B,
                               room + pol.max_inputs + pol.max_depth + 1 + Drafter.MAX_PENDING)
        self._counts = torch.zeros(4, max(pol.max_depth, pol.max_rank) + 2, dtype=torch.long, device=dev)
        self._chain_counts = [[0] * self._counts.shape[1] for _ in range(4)]
        root, self._streams = self._fill(rows, self.cache, self.drafter, generator)
        self._active_t, self._active, self._rows = None, None, None
        self._index = 0
        first = root.tolist()
        pol.begin(rows, first)
        return first

    def _fill(self, rows: list[list[int]], cache, drafter: Drafter,
              generator) -> tuple[torch.Tensor, RowStreams | None]:
        """Prefill the target on ``rows`` (its next token is each row's first root), then record the draft's
        pairs (f_t, x_{t+1}) -> (roots, the rows' random streams)."""
        tgt, dev = self.target, self.target.device
        ids, lens = pad_prompts(rows, dev)
        pre = tgt(ids, cache, logits=(lens - 1)[:, None], layer_inputs=self.draft.feature_layers_needed)
        cache.rollback([len(r) for r in rows])
        streams = None if self.sampling.greedy else RowStreams(generator, len(rows), dev)  # the target's draws, per row
        root = next_token(pre.logits[:, 0], self.sampling, streams)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter(1, (lens - 1)[:, None], root[:, None])
        drafter.catch_up(nxt, self.draft.features(pre), lens, [len(r) for r in rows], root)
        return root, streams

    def _admit(self, slots: list[int], rows: list[list[int]], generator) -> list[int]:
        """New prompts take finished rows' slots: prefilled in caches of their own (target and draft), then
        moved in (``put_rows``); the other rows' state is untouched."""
        longest = max(map(len, rows))
        cache = self.target.new_cache(len(rows), longest)
        drafter = Drafter(self.drafter.head, len(rows), longest + Drafter.MAX_PENDING)
        root, streams = self._fill(rows, cache, drafter, generator)
        self.cache.put_rows(slots, cache)
        self.drafter.put_rows(slots, drafter)
        if streams is not None:
            self._streams.put_rows(slots, streams)
        first = root.tolist()
        self.policy.admit(slots, rows, first)
        self._active = None  # the device copy of the active rows is re-made
        return first

    def _keep_rows(self, order: list[int]) -> None:
        idx = torch.tensor(order, device=self.target.device)
        self.cache.keep_rows(order)
        self.drafter.cache.keep_rows(order)
        self.drafter.keep_rows(idx, order)  # the root and any catch-up still pending
        self.policy.keep_rows(order)  # and what the policy keeps per row (prompt lookup's context)
        if self._streams is not None:
            self._streams.keep_rows(order)
        self._active = None

    def _root_only(self) -> Tree:
        """A one-node tree: the root alone, i.e. a plain decoding step."""
        return Tree.root_only(self.drafter.root_tokens)

    def _step(self, active: list[bool], generator, timer: Timer) -> tuple[StepInfo, int]:
        t0 = time.perf_counter()
        tgt, pol, cache = self.target, self.policy, self.cache
        ctx = tgt.config.context_length
        if self._active != active:  # rows finish rarely: refresh the device copies only then
            self._active, self._active_t = list(active), torch.tensor(active, device=tgt.device)
            if self._rows is None or len(self._rows) != len(active):  # (a compacting subclass cuts the batch)
                self._rows = torch.arange(len(active), device=tgt.device)[:, None]
                self._root_path = torch.zeros_like(self._rows)  # a plain step's accepted path
        live = max(L for L, a in zip(cache.host_lengths, active) if a)
        fits = live + pol.max_depth < ctx
        tree = pol.draft(self.drafter, self.sampling, generator) if fits else self._root_only()
        timer.lap("draft")
        if tree.size == 1:
            return self._plain_step(tree, active, fits, timer, t0)
        depth_cap = pol.max_depth
        # Finished rows may sit past the context: clamp their (ignored) positions.
        pos = (cache.lengths[:, None] + tree.depth).clamp(max=ctx - 1)
        if self._verify is not None:
            res = self._verify(tree.tokens, cache, pos, tree.ancestors(), "all", self.draft.feature_layers_needed)
        else:
            res = tgt(tree.tokens, cache, position_ids=pos, tree_mask=tree.ancestors(),
                      layer_inputs=self.draft.feature_layers_needed)
        timer.lap("verify")
        acc, n, packed, inner_n = self._accept(tree, res.logits, depth_cap)
        n_host = [r[0] for r in packed]
        if tree.is_chain:  # a chain's counts follow from n alone, on the host
            add_chain_counts(self._chain_counts, n_host, tree.size - 1)
        else:
            self._counts += acceptance_counts(tree, acc, self._active_t, self._counts.shape[1])
        timer.lap("accept")
        cache.commit(acc.path, n, n_host)
        f = self.draft.features(res)  # the head's target features ([B, T, H]; EAGLE-3: [B, T, 3H])
        feats = f[self._rows, acc.path]  # indexing, not gather over an expanded index: 3x faster on CPUs
        # Draft catch-up: features of the accepted nodes, tokens one ahead (accepted children, then the bonus).
        self.drafter.catch_up(acc.emit, feats, n, n_host, acc.bonus)
        timer.lap("commit")
        self._index += 1
        info = StepInfo(self._index, list(active), [r[1:1 + k] for r, k in zip(packed, n_host)], n_host,
                        tree, acc.path, res.logits, inner_n_accept=inner_n, seconds=time.perf_counter() - t0)
        self.policy.observe(info)  # host values only (the step's one read has happened)
        return info, tree.size

    def _plain_step(self, tree: Tree, active: list[bool], fits: bool, timer: Timer,
                    t0: float) -> tuple[StepInfo, int]:
        """The root alone, as vanilla decodes: a mask-free one-token forward, the target's pick at the
        root (greedy or one draw, its one host read), ``advance``; the drafter only records the pair."""
        tgt, cache = self.target, self.cache
        ctx, layers = tgt.config.context_length, self.draft.feature_layers_needed
        if self._verify is not None and fits:
            res = self._verify(tree.tokens, cache, cache.lengths[:, None], None, "last", layers)
        else:  # positions = the cache lengths, as vanilla's; finished rows may sit past the context: clamp them
            pos = cache.lengths[:, None].clamp(max=ctx - 1) if max(cache.host_lengths) >= ctx else None
            res = tgt(tree.tokens, cache, position_ids=pos, logits="last", layer_inputs=layers)
        timer.lap("verify")
        token, toks = pick(res.logits[:, -1], self.sampling, self._streams, active)
        timer.lap("accept")
        n_host = [int(a) for a in active]  # finished rows commit nothing: their caches stay frozen
        cache.advance(1 if all(active) else n_host)
        self.drafter.catch_up(token[:, None], self.draft.features(res), None, n_host, token)
        timer.lap("commit")
        self._index += 1
        info = StepInfo(self._index, list(active), [[t] if a else [] for t, a in zip(toks, active)], n_host,
                        tree, self._root_path, res.logits, seconds=time.perf_counter() - t0)
        self.policy.observe(info)
        return info, 1

    def _accept(self, tree: Tree, logits: torch.Tensor, depth_cap: int) -> tuple[Acceptance, torch.Tensor, list,
                                                                               list[int] | None]:
        """The acceptance rule and the step's one host read -> (acceptance, n [B], [n, emitted...] per row, and what
        the policy's own nodes alone accepted when others were verified beside them (``tree.inner_size``), read in the
        same transfer)."""
        if tree.draft_probs is not None:
            draws, acc = None, self._accept_sampled_drafts(tree, logits, depth_cap)
        else:
            draws = node_choices(logits, self.sampling, self._streams)
            acc = (accept_chain if tree.is_chain else accept_paths)(tree, draws.token, depth_cap, draws.miss)
        while True:
            n = torch.where(self._active_t, acc.n, 0)  # finished rows commit nothing: their caches stay frozen
            flag = [] if acc.unsettled is None else [acc.unsettled[:, None].long()]
            own = []
            if tree.inner_size is not None and draws is not None:  # the policy's nodes alone: what they accepted
                sub, k = tree.first(tree.inner_size), tree.inner_size
                miss = None if draws.miss is None else draws.miss[:, :k]
                own = [torch.where(self._active_t, accept_paths(sub, draws.token[:, :k], depth_cap, miss).n, 0)[:, None]]
            packed = torch.cat([n[:, None], acc.emit, *flag, *own], 1).tolist()  # the one host read of the step
            own_n = [r.pop() for r in packed] if own else None
            redo = [b for b, r in enumerate(packed) if flag and r[-1] and self._active[b]]
            if not redo:
                return acc, n, packed, own_n
            # Rare: a path reached a node none of whose top-p candidates was in the nucleus. Draw that
            # row's missed nodes exactly and walk again: the other rows' paths and streams are unchanged.
            acc = accept_paths(tree, settle(draws, self.sampling, self._streams, redo), depth_cap)

    def _accept_sampled_drafts(self, tree: Tree, logits: torch.Tensor, depth_cap: int) -> Acceptance:
        """SpecInfer verification of children drawn i.i.d. from q: a per-row walk (the slow, rarer path)."""
        B, T = tree.tokens.shape
        dev = logits.device
        tokens = tree.tokens.tolist()
        path = torch.zeros(B, depth_cap + 1, dtype=torch.long)
        n, bonus = torch.zeros(B, dtype=torch.long), torch.zeros(B, dtype=torch.long)
        for b in range(B):
            v = verify_sampling(tree.children(b), tokens[b], logits[b], self.sampling, tree.draft_probs[b],
                                self._streams.generators[b])
            path[b, : len(v.path)] = torch.tensor(v.path)
            n[b], bonus[b] = len(v.path), v.bonus
        path, n, bonus = path.to(dev), n.to(dev), bonus.to(dev)
        on_path = torch.zeros(B, T, dtype=torch.bool, device=dev)
        on_path.scatter_(1, torch.where(torch.arange(depth_cap + 1, device=dev) < n[:, None], path, 0), True)
        return Acceptance(path, n, bonus, emitted(tree.tokens, path, n, bonus), on_path)

    def _finish(self, stats: DecodeStats) -> None:
        self.drafter.flush()  # the end state is eager catch-up's (one head forward per generate, for whoever reads it)
        c = self._counts.tolist()
        stats.add_counts(*[[x + y for x, y in zip(row, host)] for row, host in zip(c, self._chain_counts)])


class CompactingDecoder(SpeculativeDecoder):
    """Speculative decoding that drops a row from the batch once it is done, so the draft and verify
    passes run over the live rows only (``serve(..., compact=True)``; ``serve(..., slots=k)`` also refills
    a finished row's slot with the next prompt).

    When the live set changes, the per-row state (both KV caches, the drafter's root token / feature /
    logits and the row's random stream) is cut down to the live rows (a live row from past the new width
    fills a finished row's slot, so the rows' order in the batch changes); each step's tokens are mapped
    back to the prompts. A ``hook``'s ``StepInfo`` carries no tree, path or logits (their rows would be the
    live ones). Every row still decodes exactly as in a full batch (the rows of a batched pass do not
    interact; greedy fp32 is compared token for token in the tests).
    """

    compact = True
