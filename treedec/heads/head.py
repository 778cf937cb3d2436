"""What every draft head kind shares: :class:`DraftHead`, the base of the classes of :data:`~treedec.heads.kinds.HEAD_KINDS`.

A head is a small model that reads the target's features and proposes tokens. What the decoder feeds any head:
``head.feature_layers_needed`` (layer ids whose inputs the target forward must return), ``head.features(output)``
(the target features of each position) and ``head.project(features)`` (those features in the head's input space,
what ``forward`` reads for verified positions; inside a tree it reads its own outputs). Each kind (its own file)
builds its layers and computes ``forward`` and ``logits``; here is what they all do alike: binding to a target, the
draft vocabulary, dtype and device, the bf16 copy for wide batches, the cache, saving, and the inference form
(:meth:`~DraftHead.prepare`).

A head is loaded with :func:`treedec.heads.load_head` (heads/checkpoint.py), which builds one of its file's kind
through the kind table; that table sits above this module, so the base has no ``load`` of its own.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from treedec.atomic import follow_umask
from treedec.attention import prefix_tree_mask
from treedec.heads.config import DRAFT_CONFIG, DRAFT_WEIGHTS, DraftConfig, target_fingerprint
from treedec.heads.dtype import bf16_copy
from treedec.heads.quantized import Int8Linear, int8_is_faster, is_quantized, quantize_linears
from treedec.models.cache import KVCache
from treedec.models.llama import ModelOutput, Transformer, rope_inv_freq, rope_lookup
from treedec.models.packed import pack_linears, should_pack


def check_target(target: object) -> None:
    """A head binds to a loaded model: a name (``target="tiny-code"``) would fail deep inside binding, or later."""
    if target is not None and not isinstance(target, Transformer):
        raise TypeError(f"a draft head's target is a loaded model (treedec.models.load_model({target!r})), not "
                        f"{type(target).__name__} {target!r}")


class DraftHead(nn.Module):
    """The base of every head kind; ``bind(target)`` attaches the target's shared embedding (and LM head).

    A head of a config's kind is ``build_head(cfg)`` (:mod:`treedec.heads.kinds`), one from a file
    ``load_head(path)``; this class itself builds none.
    """

    one_pass = False  # drafts per-position marginals in one pass (kinds "parallel", "dflash"), not one pass per depth
    context_only = False  # the draft cache holds the target's features alone, and every depth comes from the block
    #                       after the root (kind "dflash"); else verified positions run through the head, giving depth 1

    def __init__(self, cfg: DraftConfig):
        if type(self) is DraftHead:
            raise TypeError(f"DraftHead is the base of the head kinds: build a head of kind {cfg.kind!r} with "
                            "treedec.heads.build_head(cfg)")
        super().__init__()
        self.config = cfg
        self._build(cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.layer_config()), persistent=False)
        if cfg.draft_vocab_size:
            self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab_size))
        self._target: tuple[Transformer, ...] = ()
        self._lm_weight: torch.Tensor | None = None  # a kind sharing the target's LM head: its rows (_bind_lm_head)
        self._bf16_for_wide: tuple = ()  # (its bf16 copy, the batch from which that drafts): for_batch

    # ------------------------------------------------------------------ what each kind defines
    def _build(self, cfg: DraftConfig) -> None:
        """Create the kind's layers (``fc`` and ``layer`` at least)."""
        raise NotImplementedError

    def _check_feature_layers(self, n_layers: int) -> None:
        """A ValueError where the config's feature layers do not fit a target of ``n_layers`` layers."""
        raise NotImplementedError

    @property
    def feature_layers_needed(self) -> tuple[int, ...]:
        """Target layers whose inputs the target forward must return (``layer_inputs=``)."""
        raise NotImplementedError

    def features(self, out: ModelOutput) -> torch.Tensor:
        """The target features [B, T, F] this head reads, from a target forward's output."""
        raise NotImplementedError

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features -> what :meth:`forward` reads at verified positions."""
        raise NotImplementedError

    def _bind_lm_head(self, target: Transformer) -> None:
        """Keep what the kind needs of the target's LM head when bound (``_lm_weight``, ``_lm_packed``, ``_lm_int8``;
        nothing for a head with its own)."""

    def fuse(self) -> None:
        """Fuse q/k/v and gate/up of the kind's layers into one matmul each (file names unchanged)."""
        self.layer.fuse()

    def forward_one(self, tokens: torch.Tensor, features: torch.Tensor, cache: KVCache, offset: int,
                    position_offset: int) -> torch.Tensor | None:
        """One node per row (a chain's next draft) without module calls, where the kind has such a path; None here:
        the caller runs :meth:`forward`."""
        return None

    # ------------------------------------------------------------------ binding and the draft vocabulary
    def bind(self, target: Transformer) -> "DraftHead":
        """Share the target's embedding (and, where the kind has none of its own, LM head), on the target's device.

        The head keeps its own dtype (inputs and outputs are cast at its boundaries), so an
        fp32 head may draft for a bf16 target: on CPUs its small matmuls are faster in fp32.

        A vocabulary, width or feature-layer mismatch is a clear error; a head trained for
        another target of the same shape (fingerprints differ) decodes correctly but accepts
        little, so that is a warning naming both.
        """
        check_target(target)
        tc, dc = target.config, self.config
        if tc.vocab_size != dc.vocab_size or tc.hidden_size != dc.hidden_size:
            raise ValueError(
                f"draft head (vocab {dc.vocab_size}, hidden {dc.hidden_size}) does not fit the target "
                f"(vocab {tc.vocab_size}, hidden {tc.hidden_size}); it was trained for {dc.target or 'another model'!r}: "
                "train a head for this target with `python -m treedec.train`"
            )
        self._check_feature_layers(tc.num_hidden_layers)
        if dc.target_fingerprint:
            fp = target_fingerprint(target)
            if fp != dc.target_fingerprint:
                warnings.warn(
                    f"draft head was trained for target {dc.target or '?'!r} (fingerprint {dc.target_fingerprint}), "
                    f"but is bound to a different target (fingerprint {fp}) of the same shape: output stays exact, "
                    "but expect little acceleration (tau near 1); train a head for this target with `python -m treedec.train`",
                    stacklevel=2)
        if self.device != target.device:
            self.to(device=target.device)
        self._target = (target,)  # a tuple keeps the target out of this module's parameters
        if self._bf16_for_wide:
            self._bf16_for_wide[0].bind(target)
        self._lm_weight = self._lm_packed = self._lm_int8 = None  # what a kind sharing the target's LM head keeps of it
        self._bind_lm_head(target)
        return self

    def restrict_vocab(self, token_ids: torch.Tensor) -> "DraftHead":
        """Draft only over ``token_ids`` (e.g. the target's most frequent tokens, as EAGLE-3 does).

        The draft's LM head then multiplies by a K-row slice of the target's, which is most of a
        small head's cost per depth; tokens outside the set are never drafted (verification,
        and so the output, is unchanged). Saved with the head.
        """
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size or \
                ids.unique().numel() != ids.numel():
            raise ValueError(f"a draft vocabulary needs distinct token ids in [0, {self.config.vocab_size})")
        self.config.draft_vocab_size = ids.numel()
        self.register_buffer("vocab_ids", ids.to(self.device))
        if self._target:
            self.bind(self.target)
        return self

    def add_bf16_for_wide_batches(self, rows: int) -> "DraftHead":
        """Keep a bf16 copy of this head (packed on a CPU) that drafts for batches of ``rows`` rows or more
        (:meth:`for_batch`): a head's fastest dtype depends on how many rows its matmuls hold
        (:mod:`treedec.heads.dtype`). The copy is not part of this module (its state dict and files are
        unchanged); a quantized head has none."""
        self._bf16_for_wide = (bf16_copy(self), int(rows))
        return self

    @property
    def wide_rows(self) -> int | None:
        """The batch from which :meth:`for_batch` drafts with the bf16 copy (None: the head has none)."""
        return self._bf16_for_wide[1] if self._bf16_for_wide else None

    def for_batch(self, rows: int) -> "DraftHead":
        """The head that drafts a batch of ``rows`` rows: its bf16 copy from :attr:`wide_rows` rows on, else itself."""
        return self._bf16_for_wide[0] if self._bf16_for_wide and rows >= self._bf16_for_wide[1] else self

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary indices (what :meth:`logits` ranks) -> target token ids."""
        return self.vocab_ids[ids] if self.config.draft_vocab_size else ids

    def to_target_probs(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary [..., K] -> over the target's [..., V] (zeros outside)."""
        if not self.config.draft_vocab_size:
            return q
        out = q.new_zeros(*q.shape[:-1], self.config.vocab_size)
        return out.scatter_(-1, self.vocab_ids.expand(*q.shape[:-1], -1), q)

    @property
    def target(self) -> Transformer:
        if not self._target:
            raise RuntimeError("draft head is not bound to a target: call draft.bind(target) first")
        return self._target[0]

    # ------------------------------------------------------------------ dtype, device, cache
    def _apply(self, fn, recurse: bool = True):
        """Keep the RoPE frequencies in fp32 whatever dtype the head moves to (as the target does)."""
        out = super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.config.layer_config()).to(self.device)
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The head's compute dtype (an int8 head's: its scales', the dtype its activations keep)."""
        return self.fc.scale.dtype if isinstance(self.fc, Int8Linear) else self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    def _linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """(in, out) of the head's linears (what ``quantize="auto"`` measures)."""
        return tuple((m.in_features, m.out_features) for m in self.modules() if isinstance(m, nn.Linear))

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(c.draft_layers, batch, c.num_key_value_heads, max_len, c.head_dim, self.dtype, self.device)

    @property
    def _n_positions(self) -> int:
        """RoPE positions the head serves: the target's context, where an imported head's config says less (its drafts
        must not lose RoPE there)."""
        return max(self.config.max_position_embeddings, self.target.config.max_position_embeddings)

    def _mask_rope(self, T: int, cache: KVCache, position_ids: torch.Tensor, mask: torch.Tensor | None):
        """(dense mask, cos, sin in the head's dtype) of a cached forward: ``mask`` None is a chain after each row's
        prefix."""
        cache.check_room(T)
        host = cache.host_lengths
        if mask is None and T == 1 and min(host) == max(host):
            mask = "full"
        elif mask is None:
            chain = torch.ones(T, T, dtype=torch.bool, device=position_ids.device).tril()
            mask = prefix_tree_mask(chain, cache.lengths, max(host) + T, host_lens=host)[:, None]
        return (mask, *rope_lookup(self, position_ids, self._n_positions, self.dtype))

    # ------------------------------------------------------------------ files and the inference form
    def save(self, path: str | Path) -> None:
        """Write draft_config.json + draft.safetensors; a bound head records its target's fingerprint."""
        if is_quantized(self):
            raise ValueError("this draft head's weights are int8 (draft.quantize=int8): a file of them would not load; "
                             "save the head loaded without quantize")
        if self._target:
            self.config.target_fingerprint = target_fingerprint(self.target)
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / DRAFT_CONFIG).write_text(json.dumps(asdict(self.config), indent=2))
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(path / DRAFT_WEIGHTS))
        follow_umask(path / DRAFT_WEIGHTS)

    def prepare(self, target: Transformer | None = None, quantize: str | None = None) -> "DraftHead":
        """The inference form of a loaded head: q/k/v and gate/up fused into one matmul each (file names
        unchanged), a bf16 head's weights on a CPU packed once for oneDNN (as the target's are), its linears int8
        for few rows with ``quantize="int8"``, bound to ``target`` when given."""
        self.fuse()
        if quantize == "auto":
            quantize = "int8" if self.device.type == "cpu" and int8_is_faster(self._linear_shapes(), self.dtype) else None
        if should_pack(self):
            pack_linears(self)
        if quantize == "int8":
            quantize_linears(self, skip=("_lm_",))  # (never the target's LM head, which a bound head may hold)
        return self.bind(target) if target is not None else self


__all__ = ["DraftHead", "check_target"]
