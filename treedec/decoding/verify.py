"""Lossless acceptance rules: walk one valid root-to-leaf path of a verified draft tree.

Greedy: follow the child whose token equals the target's argmax at its parent.
Sampling (DESIGN §5): at each node, with p the target distribution (temperature/top-k/top-p
exactly as vanilla decoding), try children in rank order. Deterministic (top-k) drafts: accept
child c with probability p(c), else zero p(c) and renormalise. Sampled drafts, drawn i.i.d.
from q: accept with probability min(1, p(c)/q(c)), else p <- norm(max(p - q, 0)) (SpecInfer).
If every child fails (or the node is a leaf), the bonus token is drawn from what is left of p.
Either way the emitted token is distributed exactly as p.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from treedec.decoding.sampling import SamplingParams, sample, target_probs


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
