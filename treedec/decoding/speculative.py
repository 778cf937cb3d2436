"""The speculative loop: draft a tree, verify it in one target pass, commit, advance the draft.

Per step: the policy drafts a tree rooted at the last verified token; the target scores all
T nodes in one forward with tree attention; the acceptance rule walks one path; the target
cache keeps that path's K/V (``commit``); the draft head catches up on the accepted tokens
with the target's true features, which also yields the next tree's root children.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from treedec.decoding.drafter import Drafter
from treedec.decoding.sampling import SamplingParams, next_token
from treedec.decoding.vanilla import check_context, normalize_prompts
from treedec.decoding.verify import Verdict, verify_greedy, verify_sampling
from treedec.models.draft import DraftHead
from treedec.models.llama import Transformer
from treedec.tree.policies.base import TreePolicy


@dataclass
class SpecStats:
    steps: int = 0  # target verification passes
    new_tokens: int = 0
    accepted: Counter = field(default_factory=Counter)  # accepted draft tokens per step -> count
    depth_hits: Counter = field(default_factory=Counter)  # depth -> steps that accepted a node there
    depth_trials: Counter = field(default_factory=Counter)  # depth -> steps that reached a parent with children
    rank_hits: Counter = field(default_factory=Counter)  # sibling rank -> accepted after lower ranks failed
    rank_trials: Counter = field(default_factory=Counter)  # sibling rank -> tried
    time: dict = field(default_factory=lambda: {"prefill": 0.0, "draft": 0.0, "verify": 0.0, "accept": 0.0, "commit": 0.0})
    total_time: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens produced per target pass (accepted drafts + 1)."""
        n = sum(self.accepted.values())
        return sum((k + 1) * c for k, c in self.accepted.items()) / n if n else 0.0

    def record(self, v: Verdict) -> None:
        self.steps += 1
        self.accepted[len(v.path) - 1] += 1
        for depth, n_tried, hit in v.tried_ranks:
            self.depth_trials[depth] += 1
            self.depth_hits[depth] += hit >= 0
            for r in range(n_tried):
                self.rank_trials[r] += 1
            if hit >= 0:
                self.rank_hits[hit] += 1

    def as_dict(self) -> dict:
        rate = lambda h, t: {int(k): h[k] / t[k] for k in sorted(t) if t[k]}  # noqa: E731
        other = self.total_time - sum(self.time.values())
        return {
            "steps": self.steps, "new_tokens": self.new_tokens, "tau": self.tau,
            "tokens_per_s": self.new_tokens / self.total_time if self.total_time else 0.0,
            "accepted_hist": {int(k): v for k, v in sorted(self.accepted.items())},
            "accept_by_depth": rate(self.depth_hits, self.depth_trials),
            "accept_by_rank": rate(self.rank_hits, self.rank_trials),
            "time_split": {**self.time, "other": max(other, 0.0), "total": self.total_time},
        }


@dataclass
class GenerateResult:
    tokens: list[list[int]]  # new tokens per batch row
    stats: SpecStats


def pad_prompts(rows: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated prompt rows -> right-padded ids [B, L] and lengths [B]."""
    ids = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)] = torch.tensor(r)
    return ids.to(device), torch.tensor([len(r) for r in rows], device=device)


class SpeculativeDecoder:
    """Lossless tree speculative decoding of ``target`` with an EAGLE ``draft`` head and a tree ``policy``."""

    def __init__(self, target: Transformer, draft: DraftHead, policy: TreePolicy,
                 sampling: SamplingParams = SamplingParams(), eos_ids: Sequence[int] | None = None):
        self.target, self.draft, self.policy, self.sampling = target, draft.bind(target), policy, sampling
        self.eos = set(target.config.eos_ids if eos_ids is None else eos_ids)

    def _sync(self):
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()

    def _clock(self, stats: SpecStats, key: str, t0: float) -> float:
        self._sync()
        t1 = time.perf_counter()
        stats.time[key] += t1 - t0
        return t1

    @torch.inference_mode()
    def generate(self, prompts, max_new_tokens: int, generator: torch.Generator | None = None,
                 stream: Callable[[int, list[int]], None] | None = None) -> GenerateResult:
        """Generate up to ``max_new_tokens`` per row (stopping at EOS); ``stream(row, tokens)`` sees each new batch."""
        tgt, dev, params = self.target, self.target.device, self.sampling
        rows = normalize_prompts(prompts)  # the same input checks as vanilla decoding
        check_context(tgt, rows, max_new_tokens)
        ids, lens = pad_prompts(rows, dev)
        B, Lmax = ids.shape
        ctx = tgt.config.context_length
        need = Lmax + max_new_tokens + self.policy.max_depth + 1
        if need > ctx:
            raise ValueError(
                f"prompt ({Lmax} tokens) + max_new_tokens ({max_new_tokens}) + tree depth ({self.policy.max_depth}) "
                f"exceeds the model's context of {ctx} tokens; shorten the prompt or lower max_new_tokens"
            )
        # A row's cache may run max_depth past its budget on its last step (the path is committed whole);
        # after that it is frozen, so its tree is still written (and ignored) at the same slots.
        room = Lmax + max_new_tokens + self.policy.max_depth + 2
        cache = tgt.new_cache(B, room + self.policy.max_size)
        drafter = Drafter(self.draft, B, room + self.policy.max_inputs)
        stats, out = SpecStats(), [[] for _ in range(B)]
        done = [max_new_tokens <= 0] * B
        rows = torch.arange(B, device=dev)
        self._sync()
        t_start = t0 = time.perf_counter()

        # Prefill the target; its next token is the first root. Then prefill the draft on (f_t, x_{t+1}).
        pre = tgt(ids, cache, logits=(lens - 1)[:, None])
        cache.rollback(lens)
        root = next_token(pre.logits[:, 0], params, generator)
        nxt = torch.cat([ids[:, 1:], ids[:, :1]], 1).scatter(1, (lens - 1)[:, None], root[:, None])
        drafter.catch_up(nxt, pre.hidden, lens, root)
        self._emit(out, done, root[:, None].tolist(), [1] * B, max_new_tokens, stats, stream)
        t0 = self._clock(stats, "prefill", t0)

        while not all(done):
            tree = self.policy.draft(drafter, params, generator)
            t0 = self._clock(stats, "draft", t0)
            pos = (cache.lengths[:, None] + tree.depth).clamp(max=ctx - 1)  # clamps only frozen rows
            res = tgt(tree.tokens, cache, position_ids=pos, ancestor_bits=tree.ancestor_bits())
            t0 = self._clock(stats, "verify", t0)
            verdicts = self._accept(tree, res.logits, generator)
            for b, v in enumerate(verdicts):
                if not done[b]:
                    stats.record(v)
            t0 = self._clock(stats, "accept", t0)
            # Finished rows commit nothing: their caches stay frozen while other rows finish.
            paths = [v.path if not done[b] else [0] for b, v in enumerate(verdicts)]
            n = torch.tensor([len(p) if not done[b] else 0 for b, p in enumerate(paths)], device=dev)
            width = int(n.max())
            path_t = torch.tensor([p + [0] * (width - len(p)) for p in paths], device=dev)
            cache.commit(path_t, n)
            bonus = torch.tensor([v.bonus for v in verdicts], device=dev)
            # Draft catch-up: features of the accepted nodes, tokens one ahead (accepted children, then the bonus).
            ahead = torch.cat([tree.tokens.gather(1, path_t[:, 1:]), bonus[:, None]], 1)
            ahead = ahead.scatter(1, (n - 1).clamp(min=0)[:, None], bonus[:, None])
            feats = res.hidden[rows[:, None], path_t]
            drafter.catch_up(ahead, feats, n, bonus)
            t0 = self._clock(stats, "commit", t0)
            new = [tree.tokens[b, p[1:]].tolist() + [v.bonus] for b, (p, v) in enumerate(zip(paths, verdicts))]
            self._emit(out, done, new, [len(x) for x in new], max_new_tokens, stats, stream)
        stats.total_time = time.perf_counter() - t_start
        return GenerateResult(out, stats)

    def _accept(self, tree, logits: torch.Tensor, generator) -> list[Verdict]:
        tokens = tree.tokens.tolist()
        if self.sampling.greedy:
            argmax = logits.argmax(-1).tolist()
            return [verify_greedy(tree.children(b), tokens[b], argmax[b]) for b in range(len(tokens))]
        q = tree.draft_probs
        return [verify_sampling(tree.children(b), tokens[b], logits[b], self.sampling,
                                None if q is None else q[b], generator) for b in range(len(tokens))]

    def _emit(self, out, done, new, counts, limit, stats, stream) -> None:
        for b, toks in enumerate(new):
            if done[b]:
                continue
            toks = toks[: counts[b]][: limit - len(out[b])]
            for i, t in enumerate(toks):
                if t in self.eos:
                    toks = toks[: i + 1]
                    done[b] = True
                    break
            out[b].extend(toks)
            stats.new_tokens += len(toks)
            if len(out[b]) >= limit:
                done[b] = True
            if stream is not None and toks:
                stream(b, toks)
