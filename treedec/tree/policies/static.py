"""Static trees (EAGLE-1 / Medusa): grow a fixed shape level by level from the draft's top-k.

A node of rank r takes its parent's r-th most likely draft token. With ``sample_drafts`` the
children are instead drawn i.i.d. from the draft distribution q (which verification then
uses with the SpecInfer rule); that is classic speculative sampling on a chain.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Sequence

import torch

from treedec.attention.layout import ancestor_matrix
from treedec.conf_defaults import shipped_defaults
from treedec.sampling import SamplingParams, greedy_pick, target_probs
from treedec.tree.policies.base import TreePolicy
from treedec.tree.shapes import load_shape
from treedec.tree.tree import Tree, TreeError

_D = shipped_defaults("tree/static")  # the defaults of tree=static, written once there


class StaticPolicy(TreePolicy):
    def __init__(self, choices: Sequence[Sequence[int]] | Tree | None = None, shape: str | Mapping | None = None,
                 sample_drafts: bool = _D["sample_drafts"], scores: bool = False):
        """``choices``: the paths of the nodes (or the :class:`Tree` itself); ``shape``: a shipped shape name, a
        YAML/JSON file, or a mapping with ``choices`` (a ``tree/shape`` config).

        ``scores``: also record each node's cumulative draft log-prob (``Tree.scores``; calibration needs it).
        Decoding does not, and skipping the per-depth log-softmax saves ~10% of the drafting time.
        """
        if choices is None and shape is None:
            raise TreeError("a static tree needs `choices` (path lists) or a `shape` name/file")
        if choices is None:
            choices = shape["choices"] if isinstance(shape, Mapping) else load_shape(shape)
        self.shape = choices if isinstance(choices, Tree) else Tree.from_choices([list(c) for c in choices])
        if len(self.shape) < 2:
            raise TreeError("a static tree needs at least one draft node besides the root")
        self.sample_drafts, self.scores = sample_drafts, scores
        self.max_depth = self.shape.max_depth
        self.max_size = len(self.shape)
        self.shape.ancestors()  # memoised now, so that a step's first device plan for a batch reads nothing back
        # a chain of top-1 drafts (what Tree.is_chain vouches for): node i's parent is i - 1 and its rank 0
        self.is_chain = (self.shape.parents.tolist() == list(range(-1, len(self.shape) - 1))
                         and not any(self.shape.rank.tolist()))
        self._plan()

    def _plan(self) -> None:
        """Precompute, per depth, which nodes are drafted, from which parent slot, and who is expanded.

        Everything the hot path needs is a tensor made once per device (:meth:`_device_plan`)
        or a Python int, so drafting a static tree reads nothing back from the device.
        """
        kids, parents = self.shape.children(), self.shape.parents.tolist()
        depth, ranks = self.shape.depth.tolist(), self.shape.rank.tolist()
        levels = [[i for i in range(len(depth)) if depth[i] == d] for d in range(self.max_depth + 1)]
        expanded = [[i for i in lvl if kids[i]] for lvl in levels]  # nodes whose children get drafted
        slot = {n: j for lvl in expanded for j, n in enumerate(lvl)}  # position within its depth's expanded list
        order = [n for lvl in expanded[1:] for n in lvl]  # draft-head inputs, in input order
        forest = {n: i for i, n in enumerate(order)}
        self.max_inputs = len(order)
        self.max_rank = max(ranks[1:])
        forest_parents = torch.tensor([forest.get(parents[n], -1) for n in order], dtype=torch.long)
        self._forest_anc = ancestor_matrix(forest_parents) if order else torch.zeros(0, 0, dtype=torch.bool)
        self.steps = []
        for d in range(1, self.max_depth + 1):
            nodes = levels[d]
            grow = expanded[d] if d < self.max_depth else []
            n_prev = forest[grow[0]] if grow else 0
            self.steps.append(dict(
                nodes=torch.tensor(nodes), parent=torch.tensor([parents[n] for n in nodes]),
                slot=torch.tensor([slot[parents[n]] for n in nodes]), rank=torch.tensor([ranks[n] for n in nodes]),
                k=max(ranks[n] for n in nodes) + 1, grow=torch.tensor(grow, dtype=torch.long),
                grow_parent_slot=torch.tensor([slot[parents[n]] for n in grow], dtype=torch.long),
                anc_rows=None if len(grow) == 1 and bool(self._forest_anc[n_prev, :n_prev + 1].all())
                else self._forest_anc[n_prev:n_prev + len(grow), :n_prev + len(grow)],  # None: a chain's next node
                n_prev=n_prev, n_grow=len(grow), depth=d,
            ))
        self._on: dict = {}

    def _device_plan(self, device: torch.device, batch: int) -> tuple[list[dict], dict]:
        key = (str(device), batch)
        if key not in self._on:
            steps = [{k: v.to(device) if torch.is_tensor(v) else v for k, v in st.items()} for st in self.steps]
            rep = lambda t: t[None].expand(batch, -1).to(device)
            shape = dict(parents=rep(self.shape.parents), depth=rep(self.shape.depth), rank=rep(self.shape.rank),
                         anc=self.shape.ancestors().to(device))
            self._on = {key: (steps, shape)}  # one device/batch at a time
        return self._on[key]

    def draft(self, drafter, params: SamplingParams | None = None, generator: torch.Generator | None = None) -> Tree:
        B, T, dev = drafter.batch, len(self.shape), drafter.device
        steps, shape = self._device_plan(dev, B)
        sampled = self.sample_drafts and params is not None and not params.greedy
        if self.is_chain and drafter.one_pass:
            return self._draft_marginal_chain(drafter, shape, params if sampled else None, generator)
        if self.is_chain and not sampled:
            return self._draft_chain(drafter, shape)
        tokens = torch.zeros(B, T, dtype=torch.long, device=dev)
        tokens[:, 0] = drafter.root_tokens
        scores = torch.zeros(B, T, device=dev) if self.scores or sampled else None
        probs_out = torch.zeros(B, T, drafter.vocab_size, device=dev) if sampled else None
        logits = drafter.root_logits[:, None]  # [B, n_expanded, K]: children logits of the last depth's expanded nodes
        feat = drafter.root_feat[:, None]  # [B, n_expanded, H]: the feature those children read
        parent_ids = torch.zeros(1, dtype=torch.long, device=dev)  # tree ids of the last depth's expanded nodes
        for st in steps:
            nodes, slot, rank = st["nodes"], st["slot"], st["rank"]
            if sampled:
                q = target_probs(logits, params)  # [B, n, K] over the draft vocabulary
                probs_out[:, parent_ids] = drafter.head.to_target_probs(q)
                picks = torch.multinomial(q.flatten(0, 1), st["k"], replacement=True, generator=generator)
                picks = picks.view(B, -1, st["k"])
                logp = torch.log_softmax(logits.float(), dim=-1).gather(2, picks)
                picks = drafter.head.to_target_ids(picks)
            elif scores is not None:
                logp, picks = drafter.topk(logits, st["k"])  # [B, n, k]
            else:  # only the ranks matter: no log-softmax
                picks = drafter.head.to_target_ids(logits.topk(st["k"], dim=-1).indices)
            tokens[:, nodes] = picks[:, slot, rank]
            if scores is not None:
                scores[:, nodes] = scores[:, st["parent"]] + logp[:, slot, rank]
            if st["n_grow"]:
                grow = st["grow"]
                feat, logits = drafter.expand(tokens[:, grow], feat[:, st["grow_parent_slot"]], depth=st["depth"],
                                              anc_rows=st["anc_rows"], n_prev=st["n_prev"])
                parent_ids = grow
        return Tree(shape["parents"], shape["depth"], shape["rank"], tokens, scores, probs_out, anc=shape["anc"],
                    is_chain=self.is_chain)

    def _draft_marginal_chain(self, drafter, shape: dict, params: SamplingParams | None, generator) -> Tree:
        """A chain from a one-pass head: depth d's token is the best (or, with ``params``, a draw) of its marginal q_d,
        all depths from one head pass. A drawn chain records q_d as each node's children's distribution, exactly what
        the SpecInfer rule needs: the child was drawn from q_d whatever its ancestors are."""
        logits = drafter.marginals(len(self.shape) - 1)  # [B, D, K]
        B, D, K = logits.shape
        probs_out = None
        if params is None:
            picks = greedy_pick(logits)
        else:
            q = target_probs(logits, params)
            picks = torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(B, D)
            probs_out = torch.cat([drafter.head.to_target_probs(q), q.new_zeros(B, 1, drafter.vocab_size)], 1)
        scores = None
        if self.scores or params is not None:
            x = logits if logits.dtype == torch.float32 else logits.float()
            cum = torch.log_softmax(x, -1).gather(-1, picks[..., None])[..., 0].cumsum(1)
            scores = torch.cat([cum.new_zeros(B, 1), cum], 1)
        tokens = torch.cat([drafter.root_tokens[:, None], drafter.head.to_target_ids(picks)], 1)
        return Tree(shape["parents"], shape["depth"], shape["rank"], tokens, scores, probs_out, anc=shape["anc"],
                    is_chain=params is None)

    def _draft_chain(self, drafter, shape: dict) -> Tree:
        """:meth:`draft` for a chain of top-1 drafts: each depth's token is its parent's best, one node per pass through
        :meth:`Drafter.expand_one` where the general plan runs index and index_put kernels and the head's module calls
        (with ``scores``, the same cumulative log-probs as the general plan: the auto budget's scored chain steps)."""
        T = len(self.shape)
        ids, picks, all_logits = [drafter.root_tokens], [], []
        logits, feat = drafter.root_logits, drafter.root_feat
        for d in range(1, T):
            picks.append(greedy_pick(logits))
            ids.append(drafter.head.to_target_ids(picks[-1]))
            if self.scores:
                all_logits.append(logits)
            if d < T - 1:
                out = drafter.expand_one(ids[-1], feat, depth=d, n_prev=d - 1)
                if out is None:  # a head without the lean pass
                    out = [x[:, 0] for x in drafter.expand(ids[-1][:, None], feat[:, None], depth=d, anc_rows=None,
                                                           n_prev=d - 1)]
                feat, logits = out
        scores = None
        if self.scores:  # every depth's log-prob in one pass at the end (a log-softmax per depth: ~0.4 ms more at 16 rows)
            x = torch.stack(all_logits, 1)
            logp = torch.log_softmax(x if x.dtype == torch.float32 else x.float(), dim=-1)
            cum = logp.gather(-1, torch.stack(picks, 1)[..., None])[..., 0].cumsum(1)
            scores = torch.cat([cum.new_zeros(cum.shape[0], 1), cum], 1)  # the root's score is 0
        return Tree(shape["parents"], shape["depth"], shape["rank"], torch.stack(ids, 1), scores, anc=shape["anc"],
                    is_chain=True)

