"""Weight-only int8 linears for a draft head (``draft.quantize=int8``).

A draft head only proposes tokens: verification by the target decides what is emitted, so a head whose weights
are rounded to int8 changes the drafts at most at near-ties, never the output. On a CPU its passes are
memory-bound once the target's verify has pushed the head's weights out of the caches (a 7-deep chain's draft:
~2 ms a step, however it is compiled), and int8 weights halve the bytes: the bundled head's linears of one pass
327 -> 110 us at one row and 365 -> 139 us at four with cold caches (``aten._weight_int8pack_mm``, bf16 inputs;
docs/benchmarks.md). Scales are per output row (symmetric, absmax / 127); activations keep their dtype.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from treedec.models.packed import packed_weight, second_is_faster

QUANTIZE = ("auto", "int8")  # what ``load_head(quantize=...)`` accepts (None: full precision)
AVAILABLE = hasattr(torch.ops.aten, "_weight_int8pack_mm")


def check_quantize(quantize: str | None) -> None:
    """A ValueError unless ``quantize`` is one of :data:`QUANTIZE` or None: what the head loader accepts, checked by
    the config layer too before any model loads."""
    if quantize is not None and quantize not in QUANTIZE:
        raise ValueError(f"draft.quantize={quantize!r} is not supported; use null (full precision), "
                         f"{' or '.join(QUANTIZE)}")


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias`` with ``q`` int8 [out, in] and one scale per output row, for inputs of at most
    :attr:`max_rows` rows; wider inputs run the full-precision linear it was made from (``dense``), where the int8
    kernel, whose cost grows with the rows, is slower (16 rows and up on the bundled head's shapes). Inference only.
    """

    max_rows = 8

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dense: nn.Module | None = None):
        super().__init__()
        w = weight.detach().float()
        # the scale rounded to the activations' dtype first (the kernel multiplies by it there), then the weight to it
        scale = (w.abs().amax(1) / 127).to(weight.dtype).float().clamp(min=torch.finfo(weight.dtype).tiny)
        self.out_features, self.in_features = w.shape
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous())
        self.register_buffer("scale", scale.to(weight.dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.dense = dense

    @classmethod
    def of(cls, linear: nn.Linear) -> "Int8Linear":
        """The int8 form of ``linear``, which it keeps for wide inputs."""
        return cls(linear.weight, linear.bias, dense=linear)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the int8 one stands for, [out, in] in ``dtype``."""
        return self.qweight.to(dtype) * self.scale.to(dtype)[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.dense is not None and rows > self.max_rows:
            return self.dense(x)
        if x.device.type != "cpu":  # the int8 kernel is the CPU's; elsewhere the dequantized weight (same values)
            return F.linear(x, self.dequantized(x.dtype), self.bias)
        same = lambda t: t if t.dtype == x.dtype else t.to(x.dtype)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, self.in_features), self.qweight, same(self.scale))
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + same(self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_linears(module: nn.Module, skip: tuple[str, ...] = ()) -> nn.Module:
    """Replace every ``nn.Linear`` (packed ones included) under ``module`` by an :class:`Int8Linear` that keeps it for
    wide inputs, in place, except those whose name starts with one of ``skip``."""
    for name, parent in list(module.named_modules()):
        if name.startswith(skip) and name:
            continue
        if isinstance(parent, Int8Linear):
            continue
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and not full.startswith(skip):
                setattr(parent, child_name, Int8Linear.of(child))
    return module


@functools.lru_cache(maxsize=None)
def int8_is_faster(shapes: tuple[tuple[int, int], ...], dtype: torch.dtype, rows: tuple[int, ...] = (1, 4)) -> bool:
    """Whether int8 weights beat ``dtype`` ones (packed for oneDNN when bf16) on linears of these (in, out) ``shapes``
    at a draft head's few ``rows``, on this CPU: measured once per process (~50 ms; best of 5 interleaved rounds),
    as the answer is the machine's (``draft.quantize=auto``)."""
    if not AVAILABLE:
        return False
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g).to(dtype) for i, o in shapes]
    full = [packed_weight(w) or (lambda x, w=w: F.linear(x, w)) for w in ws]
    int8 = [Int8Linear(w) for w in ws]
    xs = [x for r in rows for x in (torch.randn(r, i, generator=g).to(dtype) for i, _ in shapes)]
    run = lambda mods: lambda: [m(x) for m, x in zip(mods * len(rows), xs)]
    return second_is_faster(run(full), run(int8), calls=1)


def is_quantized(module: nn.Module) -> bool:
    return any(isinstance(m, Int8Linear) for m in module.modules())


__all__ = ["AVAILABLE", "Int8Linear", "QUANTIZE", "check_quantize", "int8_is_faster", "is_quantized", "quantize_linears"]
