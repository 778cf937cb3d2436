"""Lightning module for causal-LM pretraining of the Llama-family :class:`treedec.models.llama.Transformer`.

Hyperparameters are plain data only (dicts, numbers, strings), so Lightning checkpoints load
with ``torch.load(..., weights_only=True)``. Training uses ``Transformer.forward_train`` (plain
causal SDPA, no KV cache); ``use_cache_path=True`` trains through the tree-aware
``forward`` with a fresh cache per batch instead (same numbers, slower).
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, ListConfig, OmegaConf

from treedec.conf_defaults import shipped_defaults
from treedec.models.config import LlamaConfig
from treedec.models.llama import Transformer
from treedec.training.schedule import WallTimeScheduled

# pretrain's optimiser settings, written once in conf/pretrain.yaml (the job passes optim.* as these arguments;
# time_budget_s reaches the module resolved to seconds, so its default here is None: steps only)
_OPTIM = shipped_defaults("pretrain", "optim")


def _plain(x: Any) -> Any:
    """OmegaConf containers -> dict/list, recursively; leaves plain data as it is."""
    if isinstance(x, (DictConfig, ListConfig)):
        return OmegaConf.to_container(x, resolve=True)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


class CausalLMModule(WallTimeScheduled):
    """Next-token cross-entropy on ``[B, seq_len + 1]`` token windows.

    ``arch``: LlamaConfig keyword arguments (HF names: vocab_size, hidden_size, ...).
    """

    def __init__(self, arch: dict, lr: float = _OPTIM["lr"], weight_decay: float = _OPTIM["weight_decay"],
                 betas: tuple = _OPTIM["betas"], warmup_steps: int = _OPTIM["warmup_steps"], max_steps: int = 10_000,
                 min_lr_ratio: float = _OPTIM["min_lr_ratio"], init_std: float = _OPTIM["init_std"],
                 use_cache_path: bool = _OPTIM["use_cache_path"], seed: int = 0,
                 time_budget_s: float | None = None):
        super().__init__()
        arch = _plain(arch)
        self.save_hyperparameters({
            "arch": arch, "lr": float(lr), "weight_decay": float(weight_decay), "betas": [float(b) for b in betas],
            "warmup_steps": int(warmup_steps), "max_steps": int(max_steps), "min_lr_ratio": float(min_lr_ratio),
            "init_std": float(init_std), "use_cache_path": bool(use_cache_path), "seed": int(seed),
            "time_budget_s": float(time_budget_s) if time_budget_s else None,
        })
        torch.manual_seed(seed)
        self.config = LlamaConfig(**arch)
        self.model = Transformer(self.config, attn_backend="sdpa")
        self._init_weights(init_std)
        self._last_step_time: float | None = None

    def _init_weights(self, std: float) -> None:
        """GPT-2/Llama-style init: N(0, std), residual output projections scaled by 1/sqrt(2 * layers)."""
        n_layers = self.config.num_hidden_layers
        for name, p in self.model.named_parameters():
            if p.dim() == 2:
                s = std / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                torch.nn.init.normal_(p, mean=0.0, std=s)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())  # tied weights counted once

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.hparams.use_cache_path:
            B, T = input_ids.shape
            cache = self.model.new_cache(B, T)
            return self.model(input_ids, cache).logits
        return self.model.forward_train(input_ids)

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        now = time.perf_counter()
        if self._last_step_time is not None:
            self.log("train/tok_per_s", batch.shape[0] * (batch.shape[1] - 1) / (now - self._last_step_time),
                     on_step=True, on_epoch=False)
        self._last_step_time = now
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        self.log("train/lr", self.hparams.lr * self.lr_multiplier(), on_step=True, on_epoch=False)
        world = self.trainer.world_size if self._trainer is not None else 1  # batches are per process
        self.log("train/tokens", float((self.global_step + 1) * batch.shape[0] * (batch.shape[1] - 1) * world),
                 on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, on_step=False, on_epoch=True, batch_size=batch.shape[0],
                 sync_dist=True)  # DDP: the mean over all ranks' batches
        return loss

    def configure_optimizers(self):
        """AdamW; weight decay on matrices only. The LR is set before every step (:class:`WallTimeScheduled`)."""
        hp = self.hparams
        decay, no_decay = [], []
        for _, p in self.model.named_parameters():
            (decay if p.dim() >= 2 else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=hp.lr * self.lr_multiplier(0), betas=tuple(hp.betas), fused=False)


__all__ = ["CausalLMModule"]
