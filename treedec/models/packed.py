"""bf16 linears on a CPU with their weights packed once for oneDNN, as inductor's weight freezing does.

A bf16 ``F.linear`` on a CPU runs oneDNN, which re-lays the weight out in its blocked format on
every call. At the sizes of a tree step that reorder is most of the call: a 256->1408 projection
at 6 rows takes 40 us, 21 us packed; the bundled model's 8192-row LM head 154-213 us, 76-133 us
packed (``python scripts/cpu_kernels.py``). Packing once keeps the same kernel and the same
accumulation, so outputs are bit for bit those of ``F.linear`` (of a contiguous input, when there is
a bias: for a strided one ``F.linear`` adds it after rounding); the price is a second copy of the
linear weights, so :func:`should_pack` leaves large models (bandwidth-bound, where the reorder is
noise) unpacked.
"""
from __future__ import annotations

import functools
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
PACK_LIMIT_BYTES = 2 << 30  # linear weights above this stay unpacked: the copy would cost more than it saves


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (same parameters, same state dict) that multiplies by a packed copy of its bf16 weight.

    Only for bf16 inference on a CPU; anything else (autograd, other dtypes or devices, a
    ``torch.compile`` trace) is plain ``F.linear``, and so is a forward with oneDNN switched off
    (``one_row_matmuls``: for one row ATen's kernel is faster still; a packed LM head is faster in
    isolation there but no faster within a step). The copy is re-packed when the weight changes
    (its version counter moves: an optimizer step, ``load_state_dict``).
    """

    _packed: torch.Tensor | None = None
    _key: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or w.device.type != "cpu"
                or not torch.backends.mkldnn.enabled or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, self.bias)
        if self._key != (w.data_ptr(), w._version):
            self.repack()
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def __getstate__(self) -> dict:
        """Copies and pickles leave the packed weight behind (an opaque oneDNN tensor has no storage to
        copy); a copy packs its own on first use."""
        state = dict(self.__dict__)
        state.pop("_packed", None)
        state.pop("_key", None)
        return state

    def repack(self) -> None:
        """Pack the current weight (done at :func:`pack_linears` time, and again whenever the weight changed)."""
        w = self.weight
        if AVAILABLE and w.dtype == torch.bfloat16 and w.device.type == "cpu":
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
            self._key = (w.data_ptr(), w._version)


def should_pack(model: nn.Module) -> bool:
    """Pack a bf16 model on a CPU whose linear weights total at most :data:`PACK_LIMIT_BYTES`."""
    lins = [m for m in model.modules() if isinstance(m, nn.Linear)]
    w = lins[0].weight if lins else None
    return (AVAILABLE and w is not None and w.dtype == torch.bfloat16 and w.device.type == "cpu"
            and sum(m.weight.numel() * 2 for m in lins) <= PACK_LIMIT_BYTES)


def pack_linears(model: nn.Module) -> nn.Module:
    """Turn every ``nn.Linear`` of ``model`` into a :class:`PackedLinear` in place, packed now (at load time,
    not inside the first generation's clock)."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = PackedLinear
            m.repack()
    return model


def packed_weight(weight: torch.Tensor) -> PackedLinear | None:
    """A bias-free :class:`PackedLinear` over ``weight`` (not a parameter of any module: a draft head's rows of
    its target's LM head), or None where packing does not apply (not bf16, not a CPU, no oneDNN)."""
    if not (AVAILABLE and weight.dtype == torch.bfloat16 and weight.device.type == "cpu"):
        return None
    lin = PackedLinear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    with torch.inference_mode(False):  # a normal tensor: the repack check reads its version counter
        w = weight.detach()
        lin.weight = nn.Parameter(w.clone() if w.is_inference() else w, requires_grad=False)
    lin.repack()
    return lin


@functools.lru_cache(maxsize=None)
def packed_bf16_is_faster(shapes: tuple[tuple[int, int], ...], rows: int = 4) -> bool:
    """Whether packed bf16 linears of these (in, out) ``shapes`` beat fp32 ones at ``rows`` rows on this CPU.

    Measured once per process (~30 ms), because the answer is the machine's: on a Xeon with AMX fp32 is 2-5x
    cheaper at a few rows (oneDNN's bf16 call has a fixed cost), on an AMD EPYC (AVX-512 BF16, no AMX) MKL's
    fp32 GEMM beyond one row is 2-3x slower than packed bf16 (docs/benchmarks.md). Best of 5 interleaved rounds.
    """
    if not AVAILABLE:
        return False
    g = torch.Generator().manual_seed(0)
    fp32 = [(torch.randn(o, i, generator=g), torch.randn(rows, i, generator=g)) for i, o in shapes]
    bf16 = [(packed_weight(w.to(torch.bfloat16)), x.to(torch.bfloat16)) for w, x in fp32]
    return second_is_faster(lambda: [F.linear(x, w) for w, x in fp32], lambda: [p(x) for p, x in bf16])


def second_is_faster(first, second, calls: int = 4, rounds: int = 5) -> bool:
    """Whether ``second()`` runs faster than ``first()`` here: best of ``rounds`` interleaved rounds of ``calls``
    calls each, after one round each to warm up (the load-time kernel choices: a shared CPU's pace drifts, so
    the two are timed in turn)."""
    with torch.inference_mode():

        def clock(run) -> float:
            t = time.perf_counter()
            for _ in range(calls):
                run()
            return time.perf_counter() - t

        best = [clock(first), clock(second)]  # (the first rounds warm up)
        for _ in range(rounds):
            best = [min(best[0], clock(first)), min(best[1], clock(second))]
    return best[1] < best[0]


__all__ = ["AVAILABLE", "PACK_LIMIT_BYTES", "PackedLinear", "pack_linears", "packed_bf16_is_faster", "packed_weight",
           "second_is_faster",
           "should_pack"]
