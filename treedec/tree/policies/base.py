"""What every tree policy is: a drafter in, a batch of :class:`~treedec.tree.tree.Tree` of one size T out."""
from __future__ import annotations

import numbers

import torch

from treedec.tree.tree import Tree, TreeError


def whole(value, key: str, least: int = 1) -> int:
    """A tree setting that must be a whole number >= ``least`` (``2.5``, ``"3"`` and ``True`` are refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise TreeError(f"tree.{key}={value!r} must be a whole number >= {least}")
    return int(value)


def ancestry(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Bool [B, T, T] ancestry (self included) of per-row parent arrays [B, T], with no host reads.

    Pointer jumping: after step s every node has marked its ancestor s levels up; the root's
    parent is clamped to itself, so ``max_depth`` fixed steps cover every node.
    """
    B, T = parents.shape
    eye = torch.eye(T, dtype=torch.bool, device=parents.device)
    anc = eye.expand(B, T, T).clone()
    up = parents.clamp(min=0)
    cur = torch.arange(T, device=parents.device).expand(B, T)
    for _ in range(max_depth):
        cur = up.gather(1, cur)
        anc.scatter_(2, cur[..., None], True)
    return anc


def topk_logp(logits: torch.Tensor, k: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens and their log-probabilities (fp32): top-k of the log-softmax.

    One fused log-softmax kernel, then top-k on it (the order, and so the tokens, are the logits'):
    inside a draft, after a head pass has streamed its weights through the caches, this is ~40 %
    cheaper than top-k on the logits plus a logsumexp (a composite of six kernels), docs/design.md §8.
    ``temperature`` scores under ``softmax(logits / t)``.
    """
    x = logits if logits.dtype == torch.float32 else logits.float()
    top = torch.log_softmax(x if temperature == 1.0 else x / temperature, dim=-1).topk(k, dim=-1)
    return top.values, top.indices


def kept_tree_constants(B: int, dev, n: int, T: int) -> dict:
    """The index tensors :func:`kept_tree` needs for up to ``n`` candidates and trees of ``T`` nodes (make them once)."""
    pos = torch.full((1, n + 1), -1, dtype=torch.long, device=dev)
    pos[:, 0] = 0
    return dict(slots=torch.arange(1, T, device=dev).expand(B, -1),
                pos=pos.expand(B, -1),  # candidate id + 1 -> its slot in the kept tree (-1: not kept)
                zero=torch.zeros(B, 1, dtype=torch.long, device=dev), zero_f=torch.zeros(B, 1, device=dev),
                zero_b=torch.zeros(B, 1, dtype=torch.bool, device=dev),
                neg1=torch.full((B, 1), -1, dtype=torch.long, device=dev))


def kept_tree(c: dict, root, toks, logq, parents1, depth, rank, keep, levels: int,
              pad: torch.Tensor | None = None) -> Tree:
    """The kept candidates ``keep`` [B, T-1] of a batch's drafted candidates as a [B, T] tree, with no host reads.

    Candidates ([B, n] fields ``toks``, ``logq``, ``depth``, ``rank``) are in drafting order, which is topological;
    ``parents1``: each candidate's parent id + 1 (0: the root); a kept candidate's parent must be kept (a score
    that never rises along a path, ties broken towards the earlier candidate, guarantees it). ``pad`` [B, T-1]:
    slots to pad. ``c``: :func:`kept_tree_constants`; ``levels``: the deepest candidate's depth.
    """
    dev = toks.device
    n = toks.shape[1]
    if pad is not None:  # padding sorts after every real node: each row's real tree comes first
        keep = torch.where(pad, keep + n, keep)
    keep = keep.sort(dim=1).values  # drafting order is topological
    is_pad = None
    if pad is not None:
        is_pad, keep = keep >= n, keep % n
    pick = lambda t: t.gather(1, keep)
    # Map a candidate's parent id + 1 to its slot in the kept tree (the root: 0).
    pos = c["pos"][:, : n + 1].scatter(1, keep + 1, c["slots"][:, : keep.shape[1]])
    new_par = pos.gather(1, pick(parents1))  # connected by construction: never -1 (tests check it)
    node_depth, node_rank = pick(depth), pick(rank)
    if is_pad is not None:  # a padding node: a depth-1 leaf under the root (positions stay valid)
        new_par, node_depth, node_rank = (torch.where(is_pad, v, t) for v, t in ((0, new_par), (1, node_depth),
                                                                                 (0, node_rank)))
    par = torch.cat([c["neg1"], new_par], 1)
    anc = ancestry(par, levels)
    pad_mask = None
    if is_pad is not None:  # it sees only itself (and the prefix): the root row is cut off
        pad_mask = torch.cat([c["zero_b"], is_pad], 1)
        anc = anc & ~(pad_mask[:, :, None] & ~torch.eye(anc.shape[-1], dtype=torch.bool, device=dev))
    return Tree(parents=par, depth=torch.cat([c["zero"], node_depth], 1), rank=torch.cat([c["zero"], node_rank], 1),
                tokens=torch.cat([root[:, None], pick(toks)], 1), scores=torch.cat([c["zero_f"], pick(logq)], 1),
                anc=anc, pad=pad_mask)


class ForestAncestry:
    """Ancestry among the inputs a policy feeds the drafter in one step, grown a depth at a time.

    Row i of :attr:`anc` says which earlier inputs (and i itself) input i may see; a new input
    inherits its parent input's row. Built on the device with two ops per depth.
    """

    def __init__(self, batch: int, capacity: int, device: torch.device):
        self.anc = torch.zeros(batch, capacity, capacity, dtype=torch.bool, device=device)
        self.n = 0

    def add(self, parent_inputs: torch.Tensor | None, n_new: int) -> torch.Tensor:
        """Append ``n_new`` inputs whose parents are input ids ``parent_inputs`` [B, n_new] (None: the root).

        Returns their rows ``[B, n_new, n_prev + n_new]`` for :meth:`Drafter.expand`.
        """
        B, cap = self.anc.shape[:2]
        lo, hi = self.n, self.n + n_new
        if parent_inputs is not None:
            self.anc[:, lo:hi] = self.anc.gather(1, parent_inputs[..., None].expand(B, n_new, cap))
        idx = torch.arange(lo, hi, device=self.anc.device)
        self.anc[:, idx, idx] = True
        self.n = hi
        return self.anc[:, lo:hi, :hi]


class TreePolicy:
    """Draws a tree of candidates from a drafter; subclasses are the static/dynamic/chain/learned policies."""

    max_depth: int  # deepest node below the root
    max_size: int  # T, root included
    max_inputs: int  # tree nodes the draft head reads per step (its cache must hold them)
    max_rank: int  # largest sibling rank a tree may hold (top-k index)

    # What the policy asks a drafter for: "nodes" (a node's children's distribution, one head pass per depth:
    # EAGLE heads), "marginals" (the distribution of every depth at once: a one-pass head) or "either".
    reads = "nodes"

    def draft(self, drafter, params=None, generator: torch.Generator | None = None):
        raise NotImplementedError

    def check_head(self, head) -> None:
        """Fail before decoding when ``head`` cannot feed this policy (a one-pass head under a node-by-node tree, an
        autoregressive one under a tree built from marginals, a tree deeper than a one-pass head drafts)."""
        name, one = type(self).__name__, bool(getattr(head, "one_pass", False))
        if one and self.reads == "nodes":
            raise TreeError(f"{name} drafts node by node, one head pass per depth; this draft head is a one-pass "
                            f"({head.config.kind}) head that drafts per-position marginals: use tree=chain, "
                            "tree=best_first or tree=auto")
        if not one and self.reads == "marginals":
            raise TreeError(f"{name} builds its tree from a one-pass head's per-position marginals; this draft head is "
                            f"an autoregressive ({head.config.kind}) head: use draft=tiny_code_dflash or "
                            "draft=tiny_code_parallel (or a one-pass head of your own), or tree=dynamic / tree=chain / "
                            "tree=auto")
        if one and self.max_depth > head.block_size:
            raise TreeError(f"{name} drafts {self.max_depth} deep, but this one-pass head drafts {head.block_size} "
                            f"positions per pass: set the tree's depth to at most {head.block_size}")

    def begin(self, prompts, first) -> None:
        """A generation starts: each row's prompt and first token (host lists, in batch order). Policies that read
        the context (prompt lookup) keep it; the others ignore it."""

    def prepare(self, target, head, rows: int, context: int, new_drafter, compiled: bool = False) -> None:
        """One-time work before decoding is timed (its seconds are reported apart as ``prepare_s``): a policy that
        sizes its trees by this machine's costs measures them here. ``rows``: the batch; ``context``: the tokens a
        row attends over; ``new_drafter(rows, room)``: a drafter of its own, so the decoder's state is untouched;
        ``compiled``: the verify pass is ``torch.compile``d."""

    def admit(self, slots, prompts, first) -> None:
        """New prompts took batch slots ``slots`` (continuous batching): like :meth:`begin`, for those rows alone."""

    def keep_rows(self, order) -> None:
        """The batch was cut to rows ``order`` (their old slots, in the new order): per-row state follows."""

    def observe(self, info) -> None:
        """What the step just verified and how long it took (a :class:`~treedec.decoding.stats.StepInfo`): policies
        that learn online use it; fixed shapes ignore it."""

    def validate(self, vocab_size: int) -> None:
        """Fail before decoding when the policy asks for more distinct tokens than the vocabulary has."""
        if self.max_rank >= vocab_size:
            raise TreeError(f"{type(self).__name__} drafts up to {self.max_rank + 1} children per node, "
                            f"but the vocabulary has only {vocab_size} tokens; lower top_k / the shape's ranks")
