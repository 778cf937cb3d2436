"""The structured schemas of ``conf/train.yaml`` and ``conf/pretrain.yaml`` (``python -m treedec.train`` /
``treedec.pretrain``): the plain groups (top level, ``optim``, ``eval``, ``paths``, ``model``) are merged onto them
by :func:`treedec.config.validate`, like every other command's; ``draft_arch`` and ``model_arch`` are checked
against :class:`~treedec.heads.config.DraftConfig` and :class:`~treedec.models.config.LlamaConfig`, and the
instantiated groups (``data``, ``trainer``, ``module``, ``logger``, ``callbacks``) against their ``_target_``
(:mod:`treedec.config.jobs`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from treedec.config.schema import ModelSchema


@dataclass
class EvalSchema:
    n_prompts: int = MISSING
    prompt_tokens: int = MISSING
    max_new_tokens: int = MISSING
    every_n_steps: int = MISSING


@dataclass
class DraftOptimSchema:
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: List[float] = MISSING
    warmup_steps: int = MISSING
    min_lr_ratio: float = MISSING
    feature_noise: float = MISSING
    w_feat: float = MISSING
    w_ce: float = MISSING
    time_budget_s: Any = MISSING
    unroll: Optional[int] = MISSING  # training-time test steps (None: 3 for eagle3, 1 for eagle)
    block_anchors: int = MISSING  # dflash: blocks per training window
    decay_gamma: Optional[float] = MISSING  # dflash: the loss decay constant (None: half the block)


@dataclass
class LMOptimSchema:
    lr: float = MISSING
    weight_decay: float = MISSING
    betas: List[float] = MISSING
    warmup_steps: int = MISSING
    min_lr_ratio: float = MISSING
    init_std: float = MISSING
    use_cache_path: bool = MISSING
    time_budget_s: Any = MISSING


@dataclass
class TrainPathsSchema:  # conf/paths/default.yaml + the tokenizer
    root_dir: str = MISSING
    data_dir: str = MISSING
    output_dir: str = MISSING
    run_dir: str = MISSING
    tokenizer: Optional[str] = MISSING


@dataclass
class PretrainPathsSchema(TrainPathsSchema):
    tokenizer: str = MISSING


@dataclass
class JobSchema:
    """Keys both jobs share."""
    seed: int = MISSING
    num_threads: int = MISSING
    export_dir: Optional[str] = MISSING
    export_dtype: str = MISSING
    ckpt_every_n_steps: int = MISSING
    log_every: int = MISSING
    requeue: str = MISSING
    callbacks: Any = MISSING  # name -> callback config (checked by _target_)
    logger: Any = MISSING  # name -> logger config (checked by _target_)
    data: Any = MISSING  # checked by _target_
    trainer: Any = MISSING  # checked by _target_
    module: Any = MISSING  # the LightningModule (conf/module), checked by _target_


@dataclass
class TrainSchema(JobSchema):
    model: ModelSchema = field(default_factory=ModelSchema)  # the frozen target (conf/model)
    draft_arch: Any = MISSING  # DraftConfig overrides: the head to train (checked against DraftConfig)
    init_from: Optional[str] = MISSING
    draft_vocab_size: int = MISSING  # > 0: export with the training data's K most frequent tokens as draft vocabulary
    optim: DraftOptimSchema = field(default_factory=DraftOptimSchema)
    eval: EvalSchema = field(default_factory=EvalSchema)
    paths: TrainPathsSchema = field(default_factory=TrainPathsSchema)


@dataclass
class PretrainSchema(JobSchema):
    model_arch: Any = MISSING  # LlamaConfig fields + asset_name (checked against LlamaConfig)
    optim: LMOptimSchema = field(default_factory=LMOptimSchema)
    paths: PretrainPathsSchema = field(default_factory=PretrainPathsSchema)


JOB_SCHEMAS = {"train": TrainSchema, "pretrain": PretrainSchema}
