"""The job ``python -m treedec.train`` runs: a draft head trained on the frozen target, exported with its metrics.

:func:`train_head` checks the options and holds the run dir (:func:`~treedec.training.trainer.run_job`), then builds
the data, the module, the τ callback and the trainer from the config, fits, and (rank 0) exports the head and
writes ``metrics.json``, committed together (:class:`~treedec.training.preemption.AfterFit`). The config is only
read: what the job derives (the tokenizer file, the head's draft vocabulary) is passed on as arguments.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from treedec.atomic import atomic_dir, write_json
from treedec.data.datasets import frequent_tokens
from treedec.data.prompts import heldout_prompts
from treedec.heads import build_head
from treedec.heads.config import BUNDLED_HEAD
from treedec.models.checkpoint import resolve_dtype, resolve_path
from treedec.models.paths import bundled_dir, export_path
from treedec.models.tokenizer import load_tokenizer
from treedec.training.draft import SpeculativeEvalCallback
from treedec.training.preemption import AfterFit
from treedec.training.schedule import seconds, time_budget
from treedec.training.trainer import build_trainer, run_job, stop_reason, use_hint

log = logging.getLogger(__name__)



def train_head(cfg: DictConfig) -> dict:
    """Train (or resume, or, when the run dir holds a finished job, report) and return ``metrics.json``."""
    return run_job(cfg, "train", _train)


def draft_vocab_size(cfg: DictConfig) -> int:
    """An EAGLE-3 head's K: ``draft_arch.draft_vocab_size`` (conf/draft_arch/eagle3.yaml), else the top-level
    ``draft_vocab_size``; both set and different is an error (one head has one vocabulary)."""
    own, top = int((cfg.draft_arch or {}).get("draft_vocab_size") or 0), int(cfg.draft_vocab_size or 0)
    if own and top and own != top:
        raise ValueError(f"draft_arch.draft_vocab_size={own} and draft_vocab_size={top} differ: set one")
    return own or top


def _train(cfg: DictConfig, run_dir: Path) -> dict:
    t0 = time.time()
    kind = (cfg.draft_arch or {}).get("kind", "eagle")
    export = export_path(cfg.export_dir, bundled_dir(BUNDLED_HEAD[kind]))
    target_dir = resolve_path(cfg.model.path)
    tok_path = cfg.paths.tokenizer or str(target_dir / "tokenizer.json")
    if not Path(tok_path).is_file():
        raise FileNotFoundError(f"no tokenizer at {tok_path}: the draft trains on the target's own tokenizer")
    dm = hydra.utils.instantiate(cfg.data, tokenizer_path=tok_path)
    dm.prepare_data()
    dm.setup("fit")

    optim = time_budget(OmegaConf.to_container(cfg.optim, resolve=True), cfg.trainer)
    draft = OmegaConf.to_container(cfg.draft_arch, resolve=True) or {}
    k3 = draft_vocab_size(cfg) if kind != "eagle" else 0
    if k3:
        draft["draft_vocab_size"] = k3
    module = hydra.utils.instantiate(cfg.module)(str(target_dir), draft=draft,
                         max_steps=int(cfg.trainer.max_steps), target_dtype=cfg.model.dtype, seed=int(cfg.seed),
                         init_from=cfg.init_from, **optim)
    if k3 and module.head.config.draft_vocab_size != k3:  # EAGLE-3's LM head is over the draft vocabulary from the
        #   start (EAGLE-1/2: restricted at export); a head started from one of that size keeps its own
        module.set_draft_vocab(frequent_tokens(dm.train_set, k3, module.head.config.vocab_size))
    log.info("draft head: %.2fM trainable parameters", sum(p.numel() for p in module.head.parameters()) / 1e6)

    tau_cb = SpeculativeEvalCallback(eval_prompts(cfg, dm, load_tokenizer(str(target_dir))),
                                     int(cfg.eval.every_n_steps), int(cfg.eval.max_new_tokens))
    trainer, resume = build_trainer(cfg, run_dir, tau_cb)
    tau0 = tau_cb.measure(module) if not resume and trainer.is_global_zero else None
    trainer.fit(module, datamodule=dm, ckpt_path=resume)
    with AfterFit() as after:  # a SIGTERM from here stops the job before its writes, or not at all (143 <=> none)
        return _finish(cfg, run_dir, trainer, module, dm, after, export=export, tau_cb=tau_cb, tau0=tau0,
                       resume=resume, t0=t0, kind=kind)


def eval_prompts(cfg: DictConfig, dm, tok) -> list[list[int]]:
    """The held-out prompts τ is measured on: the training data's own validation split where it has one."""
    n_prompts, prompt_tokens = int(cfg.eval.n_prompts), int(cfg.eval.prompt_tokens)
    if hasattr(dm, "eval_prompts"):  # held-out prompts of the training data's own validation split
        prompts = dm.eval_prompts(n_prompts, prompt_tokens, tok)
    else:
        prompts = [tok.encode(p) for p in heldout_prompts(n_prompts, prompt_tokens, getattr(dm, "root", None),
                                                          tokenizer=tok)]
    if not prompts:
        raise ValueError("no evaluation prompts: the validation split is empty (raise data.val_fraction)")
    return prompts


def _finish(cfg: DictConfig, run_dir: Path, trainer, module, dm, after, *, export, tau_cb, tau0, resume, t0,
            kind: str) -> dict:
    """After ``fit``: validate, then (rank 0) export the head and write ``metrics.json``, committed together."""
    stopped_by = stop_reason(trainer)
    val = trainer.validate(module, datamodule=dm, verbose=False)
    if not trainer.is_global_zero:  # DDP: τ, the export and metrics.json are rank 0's
        return {"steps": int(trainer.global_step), "global_rank": int(trainer.global_rank)}
    after.commit()  # a SIGTERM since fit stops the job here, before anything is written
    if export is not None:
        # A copy bound to the target (its fingerprint is saved), cast, then filled straight from the fp32 weights.
        head = build_head(module.head.config).bind(module.target).to(resolve_dtype(cfg.export_dtype))
        head.load_state_dict(module.head.state_dict())
        head.config.target = str(cfg.model.path)
        if int(cfg.draft_vocab_size) and kind == "eagle":
            head.restrict_vocab(frequent_tokens(dm.train_set, int(cfg.draft_vocab_size), head.config.vocab_size))
        atomic_dir(export, head.save)
        log.info("exported the draft head to %s; use it: %s", export, use_hint("draft", export, str(cfg.model.path)))
    max_time = cfg.trainer.get("max_time")
    metrics = {
        "steps": int(trainer.global_step), "tau_before": tau0, "tau_history": [list(h) for h in tau_cb.history],
        "tau": tau_cb.history[-1][1] if tau_cb.history else None,
        "val": {k: float(v) for k, v in (val[0] if val else {}).items()},
        "wall_time_s": time.time() - t0, "world_size": int(trainer.world_size), "resumed_from": resume,
        "export_dir": str(export) if export else None, "stopped_by": stopped_by,
        "max_steps": int(cfg.trainer.max_steps), "max_time_s": seconds(max_time) if max_time else None,
    }
    write_json(run_dir / "metrics.json", metrics)
    log.info("metrics: %s", json.dumps(metrics))
    return metrics
