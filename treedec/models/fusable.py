"""Fusing a module's Linear projections into one matmul, with the Hugging Face state-dict names kept.

q/k/v (:class:`~treedec.models.llama.Attention`) and gate/up (:class:`~treedec.models.llama.MLP`) each become
one Linear whose output is split: one matmul instead of three or two (fewer launches, x read once).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of ``parts``' outputs (weights and biases stacked)."""
    w = torch.cat([p.weight.detach() for p in parts])
    lin = nn.Linear(w.shape[1], w.shape[0], bias=parts[0].bias is not None, device="meta")
    lin.weight = nn.Parameter(w, requires_grad=parts[0].weight.requires_grad)
    if lin.bias is not None:
        lin.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=parts[0].bias.requires_grad)
    return lin


class Fusable(nn.Module):
    """A module whose Linear projections named ``_parts`` may be fused into one Linear named ``_fused``.

    One matmul instead of three (q/k/v) or two (gate/up) saves launches and re-reads of x. The
    state dict keeps the Hugging Face names either way: a post-hook splits the fused tensors on
    save and a load pre-hook concatenates HF tensors on load, so checkpoints never change.
    """

    _fused: str
    _parts: tuple[str, ...]

    def _init_hooks(self) -> None:
        self.register_state_dict_post_hook(_split_fused_state)
        self.register_load_state_dict_pre_hook(_cat_fused_state)

    @property
    def fused(self) -> bool:
        return self._fused in self._modules

    def fuse(self) -> "Fusable":
        if not self.fused:
            parts = [getattr(self, n) for n in self._parts]
            self._fused_widths = [p.out_features for p in parts]
            setattr(self, self._fused, _fused_linear(parts))
            for n in self._parts:
                delattr(self, n)
        return self

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused:
            return getattr(self, self._fused)(x).split(self._fused_widths, dim=-1)
        return tuple(getattr(self, n)(x) for n in self._parts)


def _split_fused_state(module: Fusable, state: dict, prefix: str, local_metadata) -> None:
    if not module.fused:
        return
    for suffix in ("weight", "bias"):
        t = state.pop(f"{prefix}{module._fused}.{suffix}", None)
        if t is not None:  # clones: safetensors refuses tensors that share storage
            for name, piece in zip(module._parts, t.split(module._fused_widths)):
                state[f"{prefix}{name}.{suffix}"] = piece.clone()


def _cat_fused_state(module: Fusable, state: dict, prefix: str, *args) -> None:
    if not module.fused:
        return
    for suffix in ("weight", "bias"):
        keys = [f"{prefix}{name}.{suffix}" for name in module._parts]
        if all(k in state for k in keys):
            state[f"{prefix}{module._fused}.{suffix}"] = torch.cat([state.pop(k) for k in keys])


__all__ = ["Fusable"]
