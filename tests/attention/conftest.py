"""Shared helpers for the tree-attention tests: random cases and an independent fp64 reference.

The reference walks each node's parent chain itself (it never calls ``dense_mask`` or
``ancestor_matrix``), so it checks the packed bits and every backend at once.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from treedec.tree import Tree


def random_parents(T: int, gen: torch.Generator) -> list[int]:
    """A random tree in topological order: node i's parent is uniform in [0, i)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, T)]


def chain_parents(T: int) -> list[int]:
    return [-1] + list(range(T - 1))


def star_parents(T: int) -> list[int]:
    return [-1] + [0] * (T - 1)


def visible_keys(parents: list[int], node: int, prefix_len: int) -> list[int]:
    """Key indices node may attend to: the prefix, then itself and its ancestors."""
    keys, p = list(range(prefix_len)), node
    while p != -1:
        keys.append(prefix_len + p)
        p = parents[p]
    return keys


def dense_reference(q, k, v, parents_per_row, prefix_lens, scale=None) -> torch.Tensor:
    """fp64 masked softmax from explicit per-node key lists; a row that sees nothing gives 0."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    mask = torch.zeros(B, T, S, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            mask[b, i, visible_keys(parents_per_row[b], i, int(prefix_lens[b]))] = True
    kd = k.double().cpu().repeat_interleave(G, dim=1)
    vd = v.double().cpu().repeat_interleave(G, dim=1)
    scores = torch.einsum("bhtd,bhsd->bhts", q.double().cpu(), kd) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhts,bhsd->bhtd", probs, vd)


def make_case(B=1, Hq=2, Hkv=1, T=5, D=16, prefix_lens=(7,), parents="random", dtype=torch.float32,
              per_row=False, extra=3, seed=0, device="cpu"):
    """Random q/k/v for a tree (or one tree per row when ``per_row``) and its packed bits.

    ``parents`` is "random" | "chain" | "star" | an explicit parent list. K/V carry ``extra``
    keys of garbage beyond the longest row so that out-of-range reads would show.
    """
    gen = torch.Generator().manual_seed(seed)
    prefix_lens = list(prefix_lens) if len(prefix_lens) == B else [prefix_lens[0]] * B

    def one_tree() -> list[int]:
        if isinstance(parents, (list, tuple)):
            return list(parents)
        return {"random": lambda: random_parents(T, gen), "chain": lambda: chain_parents(T),
                "star": lambda: star_parents(T)}[parents]()

    rows = [one_tree() for _ in range(B)] if per_row else [one_tree()] * B
    bits = torch.stack([Tree.from_parents(p).ancestor_bits() for p in rows]) if per_row \
        else Tree.from_parents(rows[0]).ancestor_bits()
    S = max(prefix_lens) + T + extra
    q = torch.randn(B, Hq, T, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    pl = torch.tensor(prefix_lens, dtype=torch.long)
    to = lambda t: t.to(device)
    return SimpleNamespace(q=to(q), k=to(k), v=to(v), bits=to(bits), prefix_lens=to(pl), parents=rows, T=T)


def tolerance(dtype: torch.dtype, device: str = "cpu") -> dict:
    fp32 = 2e-5 if str(device).startswith("cpu") else 2e-4  # GPU kernels reorder fp32 sums more
    return {torch.float32: dict(atol=fp32, rtol=fp32), torch.float16: dict(atol=1e-2, rtol=1e-2),
            torch.bfloat16: dict(atol=4e-2, rtol=4e-2)}[dtype]


def assert_matches_reference(out: torch.Tensor, case, dtype: torch.dtype) -> None:
    ref = dense_reference(case.q, case.k, case.v, case.parents, case.prefix_lens)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double().cpu(), ref, **tolerance(dtype, out.device.type))


@pytest.fixture
def attn_cases() -> SimpleNamespace:
    """The helpers above as one fixture (test modules share them without cross-imports)."""
    return SimpleNamespace(
        make=make_case, reference=dense_reference, check=assert_matches_reference, tol=tolerance,
        random_parents=random_parents, chain=chain_parents, star=star_parents,
    )

