"""Train an EAGLE draft head: ``python -m treedec.train [hydra overrides]``.

The target is loaded frozen (``target=tiny-code`` or a local HF directory); the head trains on
token windows of ``data`` (or, with ``data=jsonl`` on chat data, on the assistant turns of each
conversation) with the EAGLE loss, checkpoints ``last.ckpt`` into the run dir and
resumes from it when re-run with the same ``hydra.run.dir``; a callback runs the real
speculative loop on held-out prompts and logs τ. The head is exported to ``export_dir`` and
``metrics.json`` is written into the run dir.

Under DDP (``trainer=ddp``) every rank runs this script with its own copy of the frozen target;
τ is measured, and the head exported and ``metrics.json`` written, on rank 0 only.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> dict:
    import torch

    from treedec.models.checkpoint import resolve_path
    from treedec.models.draft import BUNDLED_DRAFTS
    from treedec.models.tokenizer import load_tokenizer
    from treedec.training.callbacks import build_trainer, export_path, start_job, time_budget
    from treedec.training.data import heldout_prompts
    from treedec.training.draft import DraftModule, SpeculativeEvalCallback

    t0 = time.time()
    run_dir = start_job(cfg)
    target_dir = resolve_path(cfg.target)
    tok_path = cfg.paths.tokenizer or str(target_dir / "tokenizer.json")
    if not Path(tok_path).is_file():
        raise FileNotFoundError(f"no tokenizer at {tok_path}: the draft trains on the target's own tokenizer")
    OmegaConf.set_struct(cfg, False)
    cfg.data.tokenizer_path = tok_path
    dm = hydra.utils.instantiate(cfg.data)
    dm.prepare_data()
    dm.setup("fit")

    optim = time_budget(OmegaConf.to_container(cfg.optim, resolve=True), cfg.trainer)
    module = DraftModule(str(target_dir), draft=OmegaConf.to_container(cfg.draft, resolve=True),
                         max_steps=int(cfg.trainer.max_steps), target_dtype=cfg.target_dtype, seed=int(cfg.seed),
                         init_from=cfg.init_from, **optim)
    log.info("draft head: %.2fM trainable parameters", sum(p.numel() for p in module.head.parameters()) / 1e6)

    tok = load_tokenizer(str(target_dir))
    n_prompts, prompt_tokens = int(cfg.eval.n_prompts), int(cfg.eval.prompt_tokens)
    if hasattr(dm, "eval_prompts"):  # held-out prompts of the training data's own validation split
        prompts = dm.eval_prompts(n_prompts, prompt_tokens, tok)
    else:
        prompts = [tok.encode(p) for p in heldout_prompts(n_prompts, prompt_tokens, getattr(dm, "root", None),
                                                          tokenizer=tok)]
    if not prompts:
        raise ValueError("no evaluation prompts: the validation split is empty (raise data.val_fraction)")
    tau_cb = SpeculativeEvalCallback(prompts, int(cfg.eval.every_n_steps), int(cfg.eval.max_new_tokens))
    trainer, resume = build_trainer(cfg, run_dir, tau_cb)
    tau0 = tau_cb.measure(module) if not resume and trainer.is_global_zero else None
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    val = trainer.validate(module, datamodule=dm, verbose=False)
    export = export_path(cfg.export_dir, BUNDLED_DRAFTS["tiny-code-eagle"])
    if not trainer.is_global_zero:  # DDP: τ, the export and metrics.json are rank 0's
        return {"steps": int(trainer.global_step), "global_rank": int(trainer.global_rank)}
    if export is not None:
        head = module.head.to(getattr(torch, cfg.export_dtype))
        head.config.target = str(cfg.target)
        head.save(export)
        log.info("exported draft head to %s", export)
    metrics = {
        "steps": int(trainer.global_step), "tau_before": tau0, "tau_history": tau_cb.history,
        "tau": tau_cb.history[-1][1] if tau_cb.history else None,
        "val": {k: float(v) for k, v in (val[0] if val else {}).items()},
        "wall_time_s": time.time() - t0, "world_size": int(trainer.world_size), "resumed_from": resume,
        "export_dir": str(export) if export else None,
    }
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log.info("metrics: %s", json.dumps(metrics))
    return metrics


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
