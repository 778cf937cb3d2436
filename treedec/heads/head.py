"""Draft heads: the EAGLE-1/2 head (here) and, by ``kind``, the EAGLE-3 head (:mod:`treedec.heads.eagle3`).

EAGLE-1/2 head: one decoder layer that reads the target's features.

Input at draft position t is ``fc(concat(embed(token[t+1]), feature[t]))`` — the token is one
step ahead of the feature — followed by one Llama decoder layer whose first input norm is
skipped (as in EAGLE). Its output is the predicted next feature, i.e. the target LM head's
input, so ``logits = lm_head(feature)``. The embedding and LM head are the target's own,
shared and frozen, and never written into the draft checkpoint.

What the decoder feeds any head: ``head.feature_layers_needed`` (layer ids whose inputs the
target forward must return), ``head.features(model_output)`` (the target features of each
position) and ``head.project(features)`` (those features in the head's input space, what
``forward`` reads for verified positions; inside a tree it reads its own outputs).

Here: the kind registry, binding to a target, the draft vocabulary, :meth:`~DraftHead.forward` and
:meth:`~DraftHead.logits`. Apart, one job a file: its files (:mod:`~treedec.heads.checkpoint`), its dtype on
this machine and the bf16 copy for wide batches (:mod:`~treedec.heads.dtype`), the one-node fast pass
(:mod:`~treedec.heads.one_node`), training-time test (:mod:`~treedec.heads.ttt`), the config
(:mod:`~treedec.heads.config`).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn as nn

from treedec.attention import prefix_tree_mask
from treedec.models.cache import KVCache
from treedec.heads.checkpoint import check_target, load_head, save_head
from treedec.heads.config import BUNDLED_DRAFTS  # noqa: F401  (calibration imports it from here)
from treedec.heads.config import KINDS, DraftConfig, target_fingerprint
from treedec.heads.dtype import bf16_copy
from treedec.heads.one_node import as_dtype, forward_one
from treedec.heads.ttt import forward_unrolled
from treedec.models.llama import (DecoderLayer, ModelOutput, Transformer, one_row_matmuls, rope_cos_sin, rope_inv_freq,
                                  rope_lookup)
from treedec.models.packed import PackedLinear, pack_linears, packed_weight, should_pack
from treedec.heads.quantized import Int8Linear, int8_is_faster, quantize_linears


class DraftHead(nn.Module):
    """Trainable part of an EAGLE head; ``bind(target)`` attaches the shared embedding (and LM head).

    ``DraftHead(cfg)`` builds the class of ``cfg.kind``: this one for "eagle", an
    :class:`~treedec.heads.eagle3.Eagle3Head` for "eagle3". A subclass registers its kind
    (``class Eagle3Head(DraftHead, kind="eagle3")``), so this module never imports the heads built on
    it; ``treedec/models/__init__.py`` imports them all.
    """

    _KINDS: dict[str, type] = {}
    one_pass = False  # drafts per-position marginals in one pass (kind "parallel") instead of one pass per depth

    def __init_subclass__(cls, kind: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if kind is not None:
            DraftHead._KINDS[kind] = cls

    def __new__(cls, cfg: DraftConfig | None = None, *args, **kwargs):
        if cls is DraftHead and cfg is not None and cfg.kind != "eagle":
            if cfg.kind not in DraftHead._KINDS:
                raise ValueError(f"unknown draft kind {cfg.kind!r}; treedec builds {', '.join(KINDS)}")
            cls = DraftHead._KINDS[cfg.kind]
        return super().__new__(cls)

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        self._build(cfg)
        self.register_buffer("inv_freq", rope_inv_freq(cfg.layer_config()), persistent=False)
        if cfg.draft_vocab_size:
            self.register_buffer("vocab_ids", torch.arange(cfg.draft_vocab_size))
        self._target: tuple[Transformer, ...] = ()
        self._lm_weight: torch.Tensor | None = None  # the LM head's rows of the draft vocabulary
        self._bf16_for_wide: tuple = ()  # (its bf16 copy, the batch from which that drafts): for_batch

    def _build(self, cfg: DraftConfig) -> None:
        self.fc = nn.Linear((1 + len(cfg.feature_layers)) * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layer = DecoderLayer(cfg.layer_config())
        self.layer.input_layernorm = nn.Identity()  # EAGLE skips the first input norm

    def _check_feature_layers(self, n_layers: int) -> None:
        if list(self.config.feature_layers) != [-1]:
            raise ValueError(f"an EAGLE-1/2 draft head reads the final hidden state (feature_layers=[-1]), not "
                             f"{self.config.feature_layers}; multi-layer features are kind='eagle3'")

    @property
    def feature_layers_needed(self) -> tuple[int, ...]:
        """Target layers whose inputs the target forward must return (``layer_inputs=``)."""
        return ()

    def features(self, out: ModelOutput) -> torch.Tensor:
        """The target features [B, T, F] this head reads, from a target forward's output."""
        return out.hidden

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features -> what :meth:`forward` reads at verified positions (EAGLE: the same space)."""
        return features

    def bind(self, target: Transformer) -> "DraftHead":
        """Share the target's embedding and LM head, on the target's device.

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
        self._lm_weight = self._lm_packed = self._lm_int8 = None  # an EAGLE-3 head has its own LM head; an EAGLE
        #                                                             head shares the target's
        if dc.kind == "eagle":
            w = target.lm_head.weight.detach()
            if dc.draft_vocab_size:
                w = w[self.vocab_ids]
            if w.dtype != self.dtype or dc.draft_vocab_size:  # a copy in the head's dtype
                self._lm_weight = w.to(self.dtype)
            if isinstance(self.fc, Int8Linear):  # a quantized head drafts over int8 rows of the LM head too (the
                #                                  largest of its matrices), for as many rows as its other linears
                self._lm_int8 = [Int8Linear(w.to(self.dtype))]  # (a list: not a submodule of the head)
            fc = self.fc.dense if isinstance(self.fc, Int8Linear) else self.fc
            if isinstance(fc, PackedLinear):  # a packed bf16 head multiplies by packed LM rows too: the target's
                #                                  own packed LM head when it shares it whole, else its rows packed
                shared = self._lm_weight is None and isinstance(target.lm_head, PackedLinear)
                self._lm_packed = target.lm_head if shared else packed_weight(
                    w if self._lm_weight is None else self._lm_weight)
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
        """(in, out) of the head's linears and, for a head sharing its target's LM head, of its LM rows."""
        shapes = [(m.in_features, m.out_features) for m in self.modules() if isinstance(m, nn.Linear)]
        if self.config.kind == "eagle":
            shapes.append((self.config.hidden_size, self.config.draft_vocab_size or self.config.vocab_size))
        return tuple(shapes)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        c = self.config
        return KVCache(1, batch, c.num_key_value_heads, max_len, c.head_dim, self.dtype, self.device)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, cache: KVCache,
                position_ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] (one ahead of) features [B, T, H] -> predicted features [B, T, H].

        ``mask`` is a dense [B, 1, T, S] visibility mask over the cache (from ``prefix_tree_mask``);
        None means a chain after each row's cached prefix; "full": every key is visible (one query
        over rows of one length). The cache length does not move.
        Logits cost a vocabulary-wide matmul, so they are asked for apart: :meth:`logits`.
        """
        t = self.target
        dt = self.dtype
        x = torch.cat((as_dtype(t.model.embed_tokens(tokens), dt), as_dtype(features, dt)), dim=-1)
        mask, cos, sin = self._mask_rope(tokens.shape[1], cache, position_ids, mask)
        backend = "eager" if t.attn_backend == "eager" else "sdpa"  # one small layer: a dense mask is cheapest
        with one_row_matmuls(x, tokens.numel() == 1):  # a chain's node at batch 1: ATen's kernel, as the target's step
            return self.layer(self.fc(x), cos, sin, cache, 0, None, mask, backend)

    def forward_one(self, tokens: torch.Tensor, features: torch.Tensor, cache: KVCache, offset: int,
                    position_offset: int) -> torch.Tensor | None:
        """One node per row (a chain's next draft): tokens [B], features [B, H] -> predicted features [B, H], its key
        ``offset`` slots past each row's cached length, at RoPE position length + ``position_offset``; :meth:`forward`'s
        maths without module calls (:func:`treedec.heads.one_node.forward_one`). None where this head has no
        such path (another kind, ...): the caller runs :meth:`forward`. The cache length does not move."""
        return forward_one(self, tokens, features, cache, offset, position_offset) if type(self) is DraftHead else None

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

    def logits(self, feat: torch.Tensor) -> torch.Tensor:
        """Draft logits for predicted features: over the draft vocabulary (all of the target's by default)."""
        if self._lm_int8 is not None and feat.numel() // feat.shape[-1] <= self._lm_int8[0].max_rows:
            return self._lm_int8[0](as_dtype(feat, self.dtype))
        if self._lm_packed is not None:
            return self._lm_packed(as_dtype(feat, torch.bfloat16))
        w = self.target.lm_head.weight if self._lm_weight is None else self._lm_weight
        return torch.nn.functional.linear(as_dtype(feat, w.dtype), w)

    def forward_train(self, tokens: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal pass from position 0 without a cache (training): same maths as :meth:`forward` on a chain."""
        t = self.target
        x = self.fc(torch.cat((t.model.embed_tokens(tokens), features.to(self.dtype)), dim=-1))
        B, T = tokens.shape
        cos, sin = rope_cos_sin(torch.arange(T, device=x.device)[None].expand(B, T), self.inv_freq)
        feat = self.layer.forward_causal(x, cos, sin)
        return feat, t.lm_head(feat.to(t.lm_head.weight.dtype))

    def forward_unrolled(self, tokens: torch.Tensor, features: torch.Tensor,
                         steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Training-time test: (features, logits) of each of ``steps`` unrolled steps, step 0 :meth:`forward_train`,
        step i reading step i-1's predictions (:mod:`treedec.heads.ttt`)."""
        return forward_unrolled(self, tokens, features, steps)

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path) -> None:
        """Write draft_config.json + draft.safetensors; a bound head records its target's fingerprint."""
        save_head(self, path)

    @classmethod
    def load(cls, path: str | Path, target: Transformer | None = None, dtype=None, device=None,
             quantize: str | None = None) -> "DraftHead":
        """Load a bundled head ("tiny-code-eagle", "tiny-code-eagle3", "tiny-code-parallel") or a directory
        (draft_config.json + draft.safetensors, or a published EAGLE / EAGLE-3 / P-EAGLE / speculators layout); never
        unpickles.

        ``dtype``: None keeps the file's; "auto" is :func:`~treedec.heads.dtype.inference_dtype` for the target
        (and, for an fp32 head of a bf16 CPU target, a bf16 copy for wide batches); else a dtype or its name.
        ``quantize``: "int8" rounds the head's weights to int8 for its passes of few rows (:mod:`treedec.heads.quantized`;
        the output does not change, the drafts only where the head's top tokens nearly tie); "auto": int8 on a CPU
        where that measures faster than the head's dtype; None keeps them. See
        :func:`treedec.heads.checkpoint.load_head`.
        """
        return load_head(cls, path, target, dtype=dtype, device=device, quantize=quantize)

    def prepare(self, target: Transformer | None = None, quantize: str | None = None) -> "DraftHead":
        """The inference form of a loaded head: q/k/v and gate/up fused into one matmul each (file names
        unchanged), a bf16 head's weights on a CPU packed once for oneDNN (as the target's are), its linears int8
        for few rows with ``quantize="int8"``, bound to ``target`` when given."""
        self.layer.fuse()
        if quantize == "auto":
            quantize = "int8" if self.device.type == "cpu" and int8_is_faster(self._linear_shapes(), self.dtype) else None
        if should_pack(self):
            pack_linears(self)
        if quantize == "int8":
            quantize_linears(self, skip=("_lm_",))  # (never the target's LM head, which a bound head may hold)
        return self.bind(target) if target is not None else self
