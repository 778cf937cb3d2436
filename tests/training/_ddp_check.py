"""A callback for the DDP subprocess tests: prove the ranks trained one model on different data."""
from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch


class RankSync(L.Callback):
    """At the end of training, all-gather each rank's checksum of its trainable parameters and of
    its first training batch; rank 0 writes them (one row per rank) to ``out`` as JSON."""

    def __init__(self, out: str):
        self.out, self.first_batch = Path(out), None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.first_batch is None:
            ids = batch["input_ids"] if isinstance(batch, dict) else batch
            self.first_batch = float(ids.double().mul(torch.arange(1, ids.numel() + 1, dtype=torch.float64)
                                                      .view_as(ids)).sum())

    def on_train_end(self, trainer, pl_module) -> None:
        params = sum(float(p.detach().double().sum()) for p in pl_module.parameters() if p.requires_grad)
        mine = torch.tensor([params, self.first_batch], dtype=torch.float64, device=pl_module.device)
        rows = pl_module.all_gather(mine).reshape(-1, 2).tolist()  # collective: every rank calls it
        if trainer.is_global_zero:
            self.out.write_text(json.dumps({"world_size": trainer.world_size, "ranks": rows}))
