"""Lightning module that trains an EAGLE draft head against a frozen target.

For a window x_0..x_S the target gives features f_t (its final normed hidden state) and its
next-token distribution p_t = softmax(lm_head(f_t)). The head reads (f_t + noise, x_{t+1}) and
predicts f_{t+1}; loss = w_feat · SmoothL1(f̂_{t+1}, f_{t+1}) + w_ce · CE(p_{t+1}, softmax(lm_head(f̂_{t+1}))),
as in EAGLE. The target is held outside the module's parameters, so it is never trained nor
written into a checkpoint; hyperparameters are plain data (checkpoints load with weights_only=True).

Batches are either a LongTensor ``[B, S]`` of token windows (every position is trained) or, for
chat data, a dict ``{"input_ids", "loss_mask", "attention_mask"}`` (or a tuple in that order;
the attention mask is optional) of ``[B, S]`` tensors, as :class:`treedec.data.datamodules.JsonlDataModule`
serves them. Alignment of the mask: output position ``j`` (0 <= j < S-1) reads ``(f_j, x_{j+1})``
and predicts ``f_{j+1}``, the feature of token ``x_{j+1}``, whose LM-head distribution ``p_{j+1}``
is the target's prediction of ``x_{j+2}``. Position ``j`` is trained iff ``loss_mask[j+1]`` (and
``attention_mask[j+1]``): the mask is sliced ``[:, 1:]`` exactly like the targets. So in an
assistant turn ``a_0 .. a_n`` the trained positions read ``a_0 .. a_n``, predicting the features
of ``a_0 .. a_n`` and drafting ``a_1 .. a_n`` and what follows ``a_n`` (the template's
end-of-turn marker, itself masked in); the prediction of ``a_0`` from the prompt is not trained,
since at inference the target produces ``a_0`` itself (the bonus token after the prompt).
Both loss terms and ``top1_acc`` are means over the trained positions only. Padding must be on
the right (causal attention keeps it out of every real token's features).

An EAGLE-3 head (``kind="eagle3"``) reads the inputs of three target layers and trains with
EAGLE-3's training-time test instead (:meth:`DraftModule.eagle3_losses`): ``unroll`` draft steps,
step i reading the head's own step-(i-1) outputs as a depth-i draft node reads its parent's,
with loss sum_i 0.8^i · CE(p restricted to the draft vocabulary, q_i); no feature loss.

A parallel (P-EAGLE) head (``kind="parallel"``) drafts ``block_size`` positions in one pass and trains in one pass
too (:meth:`DraftModule.parallel_losses`): depth 1 at every position, deeper depths at P-EAGLE's conditional
drop-token sample of anchors, one soft-CE mean over them all.

A DFlash head (``kind="dflash"``) trains on whole blocks anchored at random positions, all in one pass
(:meth:`DraftModule.dflash_losses`), each depth's soft CE weighted by DFlash's decay exp(-(j - 1) / gamma).
"""
from __future__ import annotations

import logging

import lightning as L
import torch
import torch.nn.functional as F

from treedec.conf_defaults import shipped_defaults
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.heads import DraftConfig, ParallelHead, build_head, load_head
from treedec.heads.parallel import cod_sample
from treedec.models import load_model
from treedec.training.lm import _plain
from treedec.training.schedule import WallTimeScheduled
from treedec.tree.policies import BestFirstPolicy, DynamicPolicy

# train's optimiser settings, written once in conf/train.yaml (the job passes optim.* as these arguments;
# time_budget_s reaches the module resolved to seconds, so its default here is None: steps only)
_OPTIM = shipped_defaults("train", "optim")


def unpack_batch(batch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(ids [B, S], keep [B, S] bool or None)`` from a LongTensor, a dict with ``input_ids`` (``ids``),
    ``loss_mask`` and ``attention_mask``, or a tuple ``(ids, loss_mask[, attention_mask])``.

    ``keep`` = loss_mask & attention_mask (either may be absent); None for a plain tensor (train
    every position). Padding must be on the right: a real token after a padded one is an error.
    """
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, dict):
        ids = batch.get("input_ids", batch.get("ids"))
        lm, att = batch.get("loss_mask"), batch.get("attention_mask")
    elif isinstance(batch, (tuple, list)) and 1 <= len(batch) <= 3:
        ids, lm, att = (list(batch) + [None, None])[:3]
    else:
        raise TypeError(f"a draft-training batch is a LongTensor [B, S], a dict with input_ids/loss_mask/"
                        f"attention_mask or a tuple (ids, loss_mask[, attention_mask]); got {type(batch).__name__}")
    if ids is None:
        raise KeyError(f"the batch has no 'input_ids' (keys: {sorted(batch)})")
    keep = None
    for m in (lm, att):
        if m is not None:
            if m.shape != ids.shape:
                raise ValueError(f"mask shape {tuple(m.shape)} differs from the ids' {tuple(ids.shape)}")
            keep = m.bool() if keep is None else keep & m.bool()
    if att is not None and (att[:, 1:].bool() & ~att[:, :-1].bool()).any():
        raise ValueError("attention_mask has a real token after padding: pad on the right")
    return ids, keep


class DraftModule(WallTimeScheduled):
    def __init__(self, target_path: str, draft: dict | None = None, lr: float = _OPTIM["lr"],
                 weight_decay: float = _OPTIM["weight_decay"], betas: tuple = _OPTIM["betas"],
                 warmup_steps: int = _OPTIM["warmup_steps"], max_steps: int = 2000,
                 min_lr_ratio: float = _OPTIM["min_lr_ratio"], feature_noise: float = _OPTIM["feature_noise"],
                 w_feat: float = _OPTIM["w_feat"], w_ce: float = _OPTIM["w_ce"], target_dtype: str = "bfloat16",
                 seed: int = 0, time_budget_s: float | None = None, init_from: str | None = None,
                 unroll: int | None = _OPTIM["unroll"], block_anchors: int = _OPTIM["block_anchors"],
                 decay_gamma: float | None = _OPTIM["decay_gamma"]):
        super().__init__()
        self.save_hyperparameters({
            "target_path": str(target_path), "draft": _plain(draft or {}), "lr": float(lr),
            "weight_decay": float(weight_decay), "betas": [float(b) for b in betas], "warmup_steps": int(warmup_steps),
            "max_steps": int(max_steps), "min_lr_ratio": float(min_lr_ratio), "feature_noise": float(feature_noise),
            "w_feat": float(w_feat), "w_ce": float(w_ce), "target_dtype": str(target_dtype), "seed": int(seed),
            "time_budget_s": float(time_budget_s) if time_budget_s else None, "init_from": init_from,
            "unroll": int(unroll) if unroll is not None else None, "block_anchors": int(block_anchors),
            "decay_gamma": float(decay_gamma) if decay_gamma is not None else None,
        })
        torch.manual_seed(seed)
        target = load_model(target_path, dtype=target_dtype).eval().requires_grad_(False)
        self._target = (target,)  # a tuple keeps the frozen target out of parameters and checkpoints
        if init_from:  # any head load_head reads: treedec's, exported or published (EAGLE / EAGLE-3)
            self.head = load_head(init_from, target=target, dtype=torch.float32)
            self.head.config.target = str(target_path)  # (a published head's names its own directory)
            want, block = (draft or {}).get("kind"), int((draft or {}).get("block_size") or 0)
            if want == "parallel" and self.head.config.kind != "parallel":  # P-EAGLE from an EAGLE-3 head
                self.head = ParallelHead.from_eagle3(self.head, block)
            elif want == "parallel" and block:  # every mask position shares one input pair: K is the config's alone
                self.head.config.block_size = block  # (draft_arch.block_size, as the saved config says)
        else:
            cfg = DraftConfig.for_target(target.config, target=str(target_path), **(draft or {}))
            self.head = build_head(cfg).bind(target)
        if self.head.config.kind != "eagle" and not init_from:
            self.head.init_from_target()  # start the output layer from the target's (set_draft_vocab redoes it)
        if unroll is not None and int(unroll) < 1:
            raise ValueError(f"optim.unroll={unroll}: unroll at least 1 draft step per batch (null: the default)")
        self._noise_gen: torch.Generator | None = None  # the feature noise's own RNG, saved in checkpoints
        self._noise_state: torch.Tensor | None = None

    @property
    def target(self):
        return self._target[0]

    def _target_to_device(self) -> None:
        """The frozen target is no submodule, so Lightning does not move it: follow the head (per rank)."""
        if self.target.device != self.device:
            self.target.to(self.device)

    def on_fit_start(self) -> None:
        self._target_to_device()

    def on_validation_start(self) -> None:
        self._target_to_device()

    def _uniform(self, like: torch.Tensor) -> torch.Tensor:
        """U(0, 1) noise shaped like ``like`` from the module's own generator (seeded by ``seed`` and the
        rank; its state is checkpointed, so a resumed run draws the noise an uninterrupted one would)."""
        g = self._noise_gen
        if g is None or g.device != like.device:
            g = torch.Generator(device=like.device)
            g.manual_seed(self.hparams.seed * 1_000_003 + self.global_rank)
            if self._noise_state is not None:
                g.set_state(self._noise_state)
                self._noise_state = None
            self._noise_gen = g
        return torch.rand(like.shape, generator=g, device=like.device, dtype=like.dtype)

    def set_draft_vocab(self, token_ids) -> None:
        """An EAGLE-3 head's draft vocabulary (fixed before training: it is its LM head's rows).

        A fresh head starts its LM head from the target's rows of these tokens; a resumed or
        ``init_from`` head keeps its own weights (and, resumed, its saved ``vocab_ids``).
        """
        self.head.restrict_vocab(token_ids)
        if not self.hparams.init_from:
            self.head.init_from_target()

    @torch.no_grad()
    def target_features(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the head's target features [B, S, F], target logits [B, S, V]) in fp32."""
        if self.head.feature_layers_needed:
            out = self.target.forward_train(ids, layer_inputs=self.head.feature_layers_needed)
            return self.head.features(out).float(), out.logits.float()
        logits, hidden = self.target.forward_train(ids, return_hidden=True)
        return hidden.float(), logits.float()

    def losses(self, batch, noise: float) -> dict:
        """The loss terms of the head's kind on a batch (a LongTensor, or ids with a loss mask: see the module docstring)."""
        ids, keep = unpack_batch(batch)
        if self.head.config.kind == "eagle3":
            return self.eagle3_losses(ids, keep, noise)
        if self.head.config.kind == "parallel":
            return self.parallel_losses(ids, keep, noise)
        if self.head.config.kind == "dflash":
            return self.dflash_losses(ids, keep)
        return self.eagle_losses(ids, keep, noise)

    def _noisy(self, feats: torch.Tensor, noise: float) -> torch.Tensor:
        """Input features of positions 0..S-2, with EAGLE's uniform ±noise."""
        inp = feats[:, :-1]
        return inp + (self._uniform(inp) * 2 - 1) * noise if noise else inp

    def eagle_losses(self, ids: torch.Tensor, keep: torch.Tensor | None, noise: float) -> dict:
        """EAGLE-1/2: SmoothL1 on the next feature + CE against the target's next-token distribution. With
        ``unroll`` > 1, the training-time test: sum_i 0.8^i of both terms at unrolled step i, which reads its own
        step i-1 predictions (:meth:`DraftHead.forward_unrolled`); ``feat_loss``/``ce``/``top1_acc`` are step 0's,
        ``*_i`` step i's. Step i trains positions j >= i (those with a parent)."""
        feats, logits = self.target_features(ids)
        steps = self.hparams.unroll or 1
        inp = self._noisy(feats, noise)
        outs = [self.head.forward_train(ids[:, 1:], inp)] if steps == 1 else \
            self.head.forward_unrolled(ids[:, 1:], inp, steps)
        want_feat, want_p, best = feats[:, 1:], logits[:, 1:].softmax(-1), logits[:, 1:].argmax(-1)
        # position j trains iff token j+1 is kept (aligned like the targets)
        w = keep[:, 1:].to(feats.dtype) if keep is not None else torch.ones_like(best, dtype=feats.dtype)
        out, loss = {}, 0.0
        for i, (pred, draft_logits) in enumerate(outs):
            wi = w.clone()
            wi[:, :i] = 0.0
            n = wi.sum().clamp_min(1.0)
            feat_loss = (F.smooth_l1_loss(pred.float(), want_feat, reduction="none").mean(-1) * wi).sum() / n
            ce = (-(want_p * draft_logits.float().log_softmax(-1)).sum(-1) * wi).sum() / n
            acc = ((draft_logits.argmax(-1) == best).to(wi.dtype) * wi).sum() / n
            sfx = f"_{i}" if i else ""
            out[f"feat_loss{sfx}"], out[f"ce{sfx}"], out[f"top1_acc{sfx}"] = feat_loss, ce, acc
            loss = loss + 0.8 ** i * (self.hparams.w_feat * feat_loss + self.hparams.w_ce * ce)
        return {"loss": loss, **out}

    def _soft_ce(self, logits: torch.Tensor, want_p: torch.Tensor, best: torch.Tensor, w: torch.Tensor):
        """(soft CE against ``want_p``, top-1 agreement with the target's ``best``) over the weights ``w``."""
        n = w.sum().clamp_min(1.0)
        ce = (-(want_p * logits.float().log_softmax(-1)).sum(-1) * w).sum() / n
        acc = ((self.head.to_target_ids(logits.argmax(-1)) == best).float() * w).sum() / n
        return ce, acc

    def _draft_targets(self, logits: torch.Tensor):
        """(the target's distribution over the draft vocabulary, its greedy token over the full one) per position."""
        want = logits[:, 1:]
        best = want.argmax(-1)  # the target's greedy token (what drafting must hit), over its full vocabulary
        if self.head.config.draft_vocab_size:
            want = want[..., self.head.vocab_ids]
        return want.softmax(-1), best

    def parallel_losses(self, ids: torch.Tensor, keep: torch.Tensor | None, noise: float) -> dict:
        """P-EAGLE's loss: one soft-CE mean over every trained element, depth 1 at every position and the mask elements
        :func:`~treedec.heads.parallel.cod_sample` draws (from the module's own generator, so a resumed run draws the
        same ones), with no weight per depth: deeper depths weigh less only by being sampled less. ``ce``/``top1_acc``:
        depth 1; ``ce_i``/``top1_acc_i``: depth i + 1."""
        feats, logits = self.target_features(ids)
        head, tokens = self.head, ids[:, 1:]
        T = tokens.shape[1]
        want_p, best = self._draft_targets(logits)
        w = keep[:, 1:].float() if keep is not None else torch.ones_like(best, dtype=torch.float)
        anchor, depth = cod_sample(T, head.block_size - 1, lambda n: self._uniform(feats.new_empty(n)).cpu())
        first, rest = head.forward_train(tokens, self._noisy(feats, noise), anchor, depth)
        at = (anchor + depth).to(ids.device)  # the position whose target distribution each mask element drafts
        depth = depth.to(ids.device)
        ce_all = torch.cat([-(want_p * first.float().log_softmax(-1)).sum(-1),
                            -(want_p[:, at] * rest.float().log_softmax(-1)).sum(-1)], 1)
        hit = torch.cat([head.to_target_ids(first.argmax(-1)) == best,
                         head.to_target_ids(rest.argmax(-1)) == best[:, at]], 1).float()
        wall = torch.cat([w, w[:, at]], 1)
        which = torch.cat([depth.new_zeros(T), depth])  # element -> its depth - 1
        out = {"loss": (ce_all * wall).sum() / wall.sum().clamp_min(1.0)}
        for i in range(int(which.max()) + 1 if which.numel() else 1):
            wi = wall * (which == i).float()
            n = wi.sum().clamp_min(1.0)
            sfx = f"_{i}" if i else ""
            out[f"ce{sfx}"], out[f"top1_acc{sfx}"] = (ce_all * wi).sum() / n, (hit * wi).sum() / n
        return out

    def dflash_losses(self, ids: torch.Tensor, keep: torch.Tensor | None) -> dict:
        """DFlash's loss: ``block_anchors`` blocks at distinct random positions a >= 1 of the window (the module's own
        generator: a resumed run draws the same), each the root x_a and ``block_size`` mask positions; mask position j
        drafts x_{a+j} and is scored by soft CE against the target's distribution there, weighted exp(-(j - 1) / gamma)
        (DFlash's decay: the first drafts decide how many are accepted; gamma null: half the block). ``ce``/``top1_acc``: depth 1;
        ``ce_i``/``top1_acc_i``: depth i + 1. No feature noise: the drafter reads the target's features as keys."""
        feats, logits = self.target_features(ids)
        head, (B, T), n = self.head, ids.shape, self.head.block_size
        A = min(self.hparams.block_anchors, T - 2)
        anchor = (self._uniform(feats.new_empty(T - 2)).argsort()[:A] + 1).sort().values
        j = torch.arange(1, n + 1, device=ids.device)
        at = anchor[:, None] + j  # [A, n] the position each mask element drafts
        ok = at <= T - 1
        at = at.clamp(max=T - 1)
        probs = logits[:, at - 1]  # [B, A, n, V]: the target's distribution of each drafted token
        best = probs.argmax(-1)
        if head.config.draft_vocab_size:
            probs = probs[..., head.vocab_ids]
        w = ok.float().expand(B, -1, -1) * (keep[:, at].float() if keep is not None else 1.0)
        ce, hit = self._block_ce(head.forward_train(ids, feats, anchor, n), probs.softmax(-1), best)
        decay = torch.exp(-(j - 1).float() / (self.hparams.decay_gamma or n / 2))
        out = {"loss": (ce * w * decay).sum() / (w * decay).sum().clamp_min(1.0)}
        for i in range(n):
            wi = w[..., i]
            m = wi.sum().clamp_min(1.0)
            sfx = f"_{i}" if i else ""
            out[f"ce{sfx}"], out[f"top1_acc{sfx}"] = (ce[..., i] * wi).sum() / m, (hit[..., i] * wi).sum() / m
        return out

    def _block_ce(self, draft_logits: torch.Tensor, want_p: torch.Tensor, best: torch.Tensor):
        """(soft CE [...] against ``want_p``, 1.0 where the draft's best token is the target's ``best``) per element."""
        ce = -(want_p * draft_logits.float().log_softmax(-1)).sum(-1)
        return ce, (self.head.to_target_ids(draft_logits.argmax(-1)) == best).float()

    def eagle3_losses(self, ids: torch.Tensor, keep: torch.Tensor | None, noise: float) -> dict:
        """EAGLE-3's training-time test: sum_i 0.8^i · soft CE of unrolled step i (``ce``, ``top1_acc``:
        step 0; ``ce_i``, ``top1_acc_i``: step i). Targets are the target's next-token distribution
        renormalised over the draft vocabulary; step i trains positions j >= i (those with a parent)."""
        feats, logits = self.target_features(ids)
        head, steps = self.head, self.hparams.unroll or 3
        step_logits = head.forward_train(ids[:, 1:], self._noisy(feats, noise), steps=steps)
        want_p, best = self._draft_targets(logits)
        w = keep[:, 1:].float() if keep is not None else torch.ones_like(best, dtype=torch.float)
        out, loss = {}, 0.0
        for i, lg in enumerate(step_logits):
            wi = w.clone()
            wi[:, :i] = 0.0
            ce, acc = self._soft_ce(lg, want_p, best, wi)
            sfx = f"_{i}" if i else ""
            out[f"ce{sfx}"], out[f"top1_acc{sfx}"] = ce, acc
            loss = loss + 0.8 ** i * ce
        return {"loss": loss, **out}

    def training_step(self, batch, batch_idx):
        out = self.losses(batch, self.hparams.feature_noise)
        for k, v in out.items():
            self.log(f"train/{k}", v, on_step=True, on_epoch=False, prog_bar=k == "loss")
        return out["loss"]

    def validation_step(self, batch, batch_idx):
        out = self.losses(batch, 0.0)
        n = unpack_batch(batch)[0].shape[0]
        for k, v in out.items():
            self.log(f"val/{k}", v, on_step=False, on_epoch=True, batch_size=n, prog_bar=k == "top1_acc",
                     sync_dist=True)  # DDP: the mean over all ranks' batches

    # ------------------------------------------------------------ optimisation (the LR: WallTimeScheduled)
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        state = self._noise_gen.get_state() if self._noise_gen is not None else self._noise_state
        if state is not None:
            checkpoint["feature_noise_rng"] = state

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self._noise_gen, self._noise_state = None, checkpoint.get("feature_noise_rng")

    def configure_optimizers(self):
        hp = self.hparams
        return torch.optim.AdamW(self.head.parameters(), lr=hp.lr * self.lr_multiplier(0), betas=tuple(hp.betas),
                                 weight_decay=hp.weight_decay)


class SpeculativeEvalCallback(L.Callback):
    """Every ``every_n_steps`` (and at the end), run the real speculative loop on held-out prompts and log τ.

    Under DDP only global rank 0 measures (the others go on to the next step and wait for it at
    the gradient all-reduce), so ``history`` is filled on rank 0 only.
    """

    def __init__(self, prompts: list[list[int]], every_n_steps: int = 250, max_new_tokens: int = 64, policy=None):
        self.prompts, self.every, self.max_new = prompts, every_n_steps, max_new_tokens
        self.policy = policy
        self.history: list[tuple[int, float]] = []

    def state_dict(self) -> dict:
        return {"history": [[int(s), float(t)] for s, t in self.history]}

    def load_state_dict(self, state_dict: dict) -> None:  # a resumed job's τ history goes on from its checkpoint
        self.history = [(int(s), float(t)) for s, t in state_dict.get("history", [])]

    def measure(self, module: DraftModule) -> float:
        target = module.target
        # A bf16 copy, as inference runs; casting the trained fp32 weights in place would round them.
        head = build_head(module.head.config)
        head.load_state_dict(module.head.state_dict())
        head = head.to(device=target.device, dtype=target.dtype).eval().bind(target)
        default = BestFirstPolicy(24, head.block_size) if head.one_pass else DynamicPolicy(24, 5, 6)
        dec = SpeculativeDecoder(target, head, self.policy or default)
        tau = dec.generate(self.prompts, self.max_new).stats.tau
        return tau

    def _log(self, trainer, module) -> None:
        if not trainer.is_global_zero:
            return
        tau = self.measure(module)
        self.history.append((trainer.global_step, tau))
        for lg in trainer.loggers:
            lg.log_metrics({"val/tau": tau}, step=trainer.global_step)
        logging.getLogger(__name__).info("step %d  speculative tau %.3f", trainer.global_step, tau)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.every and trainer.global_step % self.every == 0 and trainer.global_step > 0:
            self._log(trainer, module)

    def on_train_end(self, trainer, module) -> None:
        if not (self.history and self.history[-1][0] == trainer.global_step):  # not measured at this step yet
            self._log(trainer, module)


__all__ = ["DraftModule", "SpeculativeEvalCallback", "unpack_batch"]
