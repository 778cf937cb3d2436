"""Lossless acceptance rules: walk one valid root-to-leaf path of a verified draft tree.

The hot path is :func:`accept_paths`, on the device and for the whole batch at once: every
node gets one *choice* (the target's argmax when greedy; one draw from the target's processed
distribution p when sampling, :func:`node_choices`), and the accepted path is the deepest
chain of nodes each of which carries its parent's choice. The bonus token is the choice at the
path's last node. The path depends on the choices along it only, so a node whose top-p draw
missed (``Draws.miss``, rare) matters only when the path reaches it (``Acceptance.unsettled``):
the decoder then settles that row's missed nodes exactly and walks again.

For sampling this is the sequential rule for deterministic drafts (children are distinct
tokens: top-k) in another form: "accept child c with probability p(c), else zero p(c) and
renormalise; when every child failed draw the bonus from what is left" gives P(child i) =
p(c_i) and a bonus distributed as p restricted to the non-children, and so does "draw x ~ p;
move to the child carrying x, or emit x as the bonus". docs/design.md has the proof.

Children drawn i.i.d. from the draft distribution q (``sample_drafts``) need the SpecInfer
rule, :func:`verify_sampling`: accept with probability min(1, p(c)/q(c)), else
p <- norm(max(p - q, 0)). :func:`verify_greedy` is the readable host-side reference of the
greedy walk, used by tests and simulations.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from treedec.sampling import Draws, RowStreams, SamplingParams, draw_from, sample, target_probs


@dataclass
class Acceptance:
    """The accepted paths of a batch of trees, all on the device."""

    path: torch.Tensor  # [B, D+1] node ids root first; entries past n are padding (0)
    n: torch.Tensor  # [B] accepted nodes, root included (1..D+1)
    bonus: torch.Tensor  # [B] the target's own token after the path
    emit: torch.Tensor  # [B, D+1] tokens the step produces: path tokens after the root, then the bonus at n-1
    on_path: torch.Tensor  # [B, T] bool
    unsettled: torch.Tensor | None = None  # [B] bool: the path reached a node whose draw missed (see Draws)


def node_choices(logits: torch.Tensor, params: SamplingParams, streams: RowStreams | None = None) -> Draws:
    """The target's pick at every node [B, T]: argmax (greedy) or one draw from p (sampling), batched.

    Each node draws from the same :func:`~treedec.sampling.draw` as vanilla decoding,
    row b's uniforms from row b's stream.
    """
    return draw_from(logits, params, streams)


def _per_row(t: torch.Tensor, B: int, dims: int = 2) -> torch.Tensor:
    """A tree field shared by the batch (one dimension fewer than ``dims``) as a view per row; per-row ones as they are."""
    return t if t.dim() == dims else t.expand(B, *t.shape)


def accept_paths(tree, choice: torch.Tensor, max_depth: int, miss: torch.Tensor | None = None) -> Acceptance:
    """Deepest path whose every node carries its parent's choice, batched, with no host reads.

    ``tree`` has [B, T] ``parents``/``depth``/``tokens`` and its ancestry (``tree.ancestors()``);
    siblings must be distinct tokens (top-k drafts), so at most one child of a node matches.
    ``miss`` [B, T]: nodes whose choice is a placeholder; rows whose path meets one are ``unsettled``.
    """
    parents, depth, tokens = tree.parents, tree.depth, tree.tokens
    B, T = tokens.shape
    anc = _per_row(tree.ancestors(), B, 3)
    match = tokens == choice.gather(1, parents.clamp(min=0))
    match[:, 0] = True
    if getattr(tree, "pad", None) is not None:  # padding nodes (per-row budgets) are never accepted
        match &= ~tree.pad
    ok = ~(anc & ~match[:, None, :]).any(-1)  # every ancestor (and the node) matched
    best = torch.where(ok, depth, -1).argmax(-1)  # deepest accepted node (argmax: the earliest of equals)
    rows = torch.arange(B, device=tokens.device)
    on_path = anc[rows, best]
    n = depth[rows, best] + 1
    slot = torch.where(on_path, depth, max_depth + 1)
    path = torch.zeros(B, max_depth + 2, dtype=torch.long, device=tokens.device)
    path.scatter_(1, slot, torch.arange(T, device=tokens.device).expand(B, T))
    path = path[:, : max_depth + 1]
    bonus = choice[rows, best]
    unsettled = None if miss is None else (on_path & miss).any(-1)
    return Acceptance(path, n, bonus, emitted(tokens, path, n, bonus), on_path, unsettled)


def accept_chain(tree, choice: torch.Tensor, max_depth: int, miss: torch.Tensor | None = None) -> Acceptance:
    """:func:`accept_paths` for a chain (``tree.is_chain``: node i's parent is i - 1): the longest run of drafts each
    equal to its parent's choice. The same result in ~a third of the ops (~25 against ~70 us a step on a CPU), which
    matters where a step is a few ms."""
    tokens = tree.tokens
    T = tokens.shape[1]
    run = (tokens[:, 1:] == choice[:, :-1]).cumprod(1).sum(1)  # accepted drafts per row
    n = run + 1
    idx = torch.arange(max_depth + 1, device=tokens.device)
    path = torch.where(idx < n[:, None], idx, 0)
    bonus = choice.gather(1, run[:, None])[:, 0]
    on_path = idx[:T] < n[:, None]
    unsettled = None if miss is None else (on_path & miss).any(-1)
    return Acceptance(path, n, bonus, emitted(tokens, path, n, bonus), on_path, unsettled)


def emitted(tokens: torch.Tensor, path: torch.Tensor, n: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """[B, D+1] tokens a step produces: the accepted children in path order, then the bonus at n - 1.

    They are also the draft catch-up's tokens, one step ahead of the path's features.
    """
    out = tokens.gather(1, torch.cat([path[:, 1:], path[:, :1]], 1))
    return out.scatter(1, (n - 1)[:, None], bonus[:, None])


def acceptance_counts(tree, acc: Acceptance, active: torch.Tensor, width: int) -> torch.Tensor:
    """Per-step [4, width] counts (depth hits, depth trials, rank hits, rank trials) on the device.

    Depths and ranks at or past ``width - 1`` share the last bin.

    A child is *tried* when its parent is on the accepted path and no lower-ranked sibling
    was accepted before it (the order the sequential walk tries children in).
    """
    parents, depth, rank = tree.parents, tree.depth, tree.rank
    B, T = parents.shape
    W = width
    on = acc.on_path & active[:, None]
    is_child = torch.arange(T, device=parents.device)[None] > 0
    if getattr(tree, "pad", None) is not None:  # padding is never tried
        is_child = is_child & ~tree.pad
    par = parents.clamp(min=0)
    parent_on = on.gather(1, par) & is_child
    hit = on & is_child
    # next_rank[p]: rank of p's accepted child (none: every child of p was tried); column T is a dump.
    next_rank = torch.full((B, T + 1), T + W, dtype=torch.long, device=parents.device)
    next_rank.scatter_(1, torch.where(hit, par, T), torch.where(hit, rank, T + W))
    tried = parent_on & (rank <= next_rank.gather(1, par))
    out = torch.zeros(4, B, W, dtype=torch.long, device=parents.device)
    out[0].scatter_add_(1, depth.clamp(max=W - 1), hit.long())
    out[1].scatter_add_(1, depth.clamp(max=W - 1), tried.long())
    out[1].clamp_(max=1)  # a depth is tried once per row-step
    out[2].scatter_add_(1, rank.clamp(max=W - 1), hit.long())
    out[3].scatter_add_(1, rank.clamp(max=W - 1), tried.long())
    return out.sum(1)


def add_chain_counts(counts: list[list[int]], n: Sequence[int], depth: int) -> None:
    """:func:`acceptance_counts` of a chain of ``depth`` top-1 drafts (``Tree.is_chain``), from each row's accepted
    nodes ``n`` (root included, 0 for a finished row) on the host, added into ``counts`` [4][width] (width > depth, as
    the decoder's): the drafts at depths 1..n-1 were accepted, those at 1..min(n, depth) tried, all of rank 0.
    (~30 device ops a step fewer, known once n is read.)"""
    W = len(counts[0])
    if W <= depth:
        raise ValueError(f"counts of width {W} cannot hold a {depth}-deep chain's depths apart")
    for k in n:
        if k <= 0:
            continue
        for d in range(1, k):  # k <= depth + 1 < W + 1: every depth has its own bin
            counts[0][d] += 1
        for d in range(1, min(k, depth) + 1):
            counts[1][d] += 1
        counts[2][0] += k - 1
        counts[3][0] += min(k, depth)


@dataclass
class Verdict:
    path: list[int]  # accepted node ids, root first
    bonus: int  # the target's own next token after the path
    tried_ranks: list[tuple[int, int, int]] = field(default_factory=list)  # (depth, n_ranks_tried, accepted rank or -1)


def verify_greedy(children: list[list[int]], tokens: list[int], argmax: list[int], depth: list[int] | None = None) -> Verdict:
    node, path, tried = 0, [0], []
    while True:
        want = argmax[node]
        kids = children[node]
        hit = next((i for i, c in enumerate(kids) if tokens[c] == want), -1)
        if kids:
            tried.append((len(path), hit + 1 if hit >= 0 else len(kids), hit))
        if hit < 0:
            return Verdict(path, want, tried)
        node = kids[hit]
        path.append(node)


def verify_sampling(children: list[list[int]], tokens: list[int], logits: torch.Tensor, params: SamplingParams,
                    draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Verdict:
    """``logits`` [T, V] of the target at each node; ``draft_probs`` [T, V] = q per parent for sampled drafts."""
    node, path, tried = 0, [0], []
    while True:
        p = target_probs(logits[node], params)
        kids = children[node]
        hit = -1
        for i, c in enumerate(kids):
            x = tokens[c]
            u = float(torch.rand((), generator=generator, device=p.device))
            if draft_probs is None:
                if u < float(p[x]):
                    hit = i
                    break
                p[x] = 0.0
            else:
                q = draft_probs[node].float()
                if float(q[x]) > 0 and u < min(1.0, float(p[x]) / float(q[x])):
                    hit = i
                    break
                p = (p - q).clamp(min=0)
            total = float(p.sum())
            if total <= 0:  # numerically everything was used up: the next try would have been certain
                p = target_probs(logits[node], params)
                break
            p = p / total
        if kids:
            tried.append((len(path), hit + 1 if hit >= 0 else len(kids), hit))
        if hit < 0:
            return Verdict(path, int(sample(p, generator)), tried)
        node = kids[hit]
        path.append(node)
