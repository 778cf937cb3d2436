"""Which dtype a draft head drafts in on this machine: its own, chosen at load, and a bf16 copy for wide batches.

A head runs a handful of rows per matmul, and which dtype is cheaper there is the machine's (oneDNN's bf16 call
has a fixed cost, fp32 a cost per row). ``load_head(..., dtype="auto")`` takes :func:`inference_dtype`'s
choice at 4 rows; an fp32 head bound to a bf16 CPU target then also keeps a packed bf16 copy of itself
(:func:`bf16_copy`) that drafts batches from :func:`wide_batch_rows` rows up (``DraftHead.for_batch``).
Both are measured once per process (:func:`~treedec.models.packed.packed_bf16_is_faster`).
"""
from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn as nn

from treedec.heads.config import DraftConfig
from treedec.heads.quantized import is_quantized
from treedec.models.llama import Transformer
from treedec.models.packed import packed_bf16_is_faster


def inference_dtype(target: Transformer | None, device=None) -> torch.dtype | None:
    """The head's dtype for ``dtype="auto"``: the target's on a GPU; on a CPU fp32, or for a bf16 target bf16
    (packed) where this CPU runs the head's few-row matmuls faster so.

    A head runs a handful of rows per matmul (a chain's one node, a catch-up's accepted tokens, a batch's rows),
    and which dtype is cheaper there is the machine's: on a Xeon with AMX oneDNN's bf16 call has a fixed
    ~20 us cost and fp32 is 2-5x cheaper; on an AMD EPYC (AVX-512 BF16, no AMX) fp32 beyond one row is 2-3x
    slower than packed bf16, and a bf16 head drafted 4-10 % faster at batches 1 and 4 (docs/benchmarks.md).
    So it is measured once per process on the head's shapes at 4 rows (:func:`packed_bf16_is_faster`). The
    head's inputs and outputs are cast at its boundaries either way.
    """
    dev = torch.device(device) if device is not None else target.device if target is not None else torch.device("cpu")
    if dev.type != "cpu":
        return target.dtype if target is not None else None
    if target is None or target.dtype != torch.bfloat16:
        return torch.float32
    return torch.bfloat16 if packed_bf16_is_faster(head_shapes(target)) else torch.float32


def head_shapes(target: Transformer) -> tuple[tuple[int, int], ...]:
    """(in, out) of a head's linears for ``target`` (the LM rows cut at 2048, a typical draft vocabulary)."""
    c = target.config
    H, qkv = c.hidden_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return (2 * H, H), (H, qkv), (H, 2 * c.intermediate_size), (c.intermediate_size, H), (H, min(c.vocab_size, 2048))


WIDE_ROWS = (8, 16, 32)  # the batch sizes tried, smallest first, for a head's bf16 copy (see wide_batch_rows)


def wide_batch_rows(target: Transformer) -> int | None:
    """The smallest batch of :data:`WIDE_ROWS` from which a head for this bf16 ``target`` drafts faster in packed
    bf16 than in fp32 on this CPU (None: at none of them; measured once per process and row count).

    :func:`inference_dtype` picks the head's dtype at 4 rows, a chain's pass at batch 4. A batch's pass holds one
    node per row, and oneDNN's fixed ~20 us a bf16 call is soon less than fp32's cost per row: on a Xeon with AMX,
    fp32 is 2-5x cheaper at 1-8 rows and 2x dearer at 16 (a 256->1408 projection 71 against 31 us), and a 5-deep
    chain at batch 16 ran 1.32x vanilla with an fp32 head, 1.49x with a bf16 one (docs/benchmarks.md).
    """
    if target.device.type != "cpu" or target.dtype != torch.bfloat16:
        return None
    return next((r for r in WIDE_ROWS if packed_bf16_is_faster(head_shapes(target), r)), None)


def bf16_copy(head: nn.Module) -> nn.Module:
    """A copy of ``head`` in bf16 (packed on a CPU), prepared and bound as the head is: what drafts its wide batches.

    Not part of the head (its state dict and files are unchanged); a quantized head has none."""
    if is_quantized(head):
        raise ValueError("an int8 head (draft.quantize=int8) keeps no bf16 copy for wide batches: its dense linears "
                         "serve wide inputs already")
    copy = type(head)(DraftConfig(**asdict(head.config)))
    copy.load_state_dict(head.state_dict())
    return copy.to(device=head.device, dtype=torch.bfloat16).prepare(head.target if head._target else None)


def with_bf16_for_wide_batches(head: nn.Module, auto: bool) -> nn.Module:
    """``dtype="auto"``: an fp32 head bound to a bf16 CPU target gets a packed bf16 copy for the batches where that
    measures faster (:func:`wide_batch_rows`); any other head is returned as it is."""
    if auto and head._target and head.dtype == torch.float32 and not is_quantized(head):
        rows = wide_batch_rows(head.target)
        if rows is not None:
            head.add_bf16_for_wide_batches(rows)
    return head


__all__ = ["WIDE_ROWS", "bf16_copy", "head_shapes", "inference_dtype", "wide_batch_rows", "with_bf16_for_wide_batches"]
