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
    n_prompts: int = 6
    prompt_tokens: int = 96
    max_new_tokens: int = 64
    every_n_steps: int = 200


@dataclass
class DraftOptimSchema:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    feature_noise: float = 0.1
    w_feat: float = 1.0
    w_ce: float = 0.1
    time_budget_s: Any = "auto"
    unroll: Optional[int] = None  # training-time test steps (None: 3 for eagle3, 1 for eagle)


@dataclass
class LMOptimSchema:
    lr: float = 2e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    init_std: float = 0.02
    use_cache_path: bool = False
    time_budget_s: Any = "auto"


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
    seed: int = 0
    num_threads: int = 2
    export_dir: Optional[str] = MISSING
    export_dtype: str = "bfloat16"
    ckpt_every_n_steps: int = 100
    log_every: int = 10
    requeue: str = "auto"
    callbacks: Any = MISSING  # name -> callback config (checked by _target_)
    logger: Any = MISSING  # name -> logger config (checked by _target_)
    data: Any = MISSING  # checked by _target_
    trainer: Any = MISSING  # checked by _target_
    module: Any = MISSING  # the LightningModule (conf/module), checked by _target_


@dataclass
class TrainSchema(JobSchema):
    model: ModelSchema = field(default_factory=ModelSchema)  # the frozen target (conf/model)
    draft_arch: Any = MISSING  # DraftConfig overrides: the head to train (checked against DraftConfig)
    init_from: Optional[str] = None
    draft_vocab_size: int = 0  # > 0: export with the training data's K most frequent tokens as draft vocabulary
    optim: DraftOptimSchema = field(default_factory=DraftOptimSchema)
    eval: EvalSchema = field(default_factory=EvalSchema)
    paths: TrainPathsSchema = field(default_factory=TrainPathsSchema)


@dataclass
class PretrainSchema(JobSchema):
    model_arch: Any = MISSING  # LlamaConfig fields + asset_name (checked against LlamaConfig)
    optim: LMOptimSchema = field(default_factory=LMOptimSchema)
    paths: PretrainPathsSchema = field(default_factory=PretrainPathsSchema)


JOB_SCHEMAS = {"train": TrainSchema, "pretrain": PretrainSchema}
