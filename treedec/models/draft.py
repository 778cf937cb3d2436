"""Draft heads: the EAGLE-1/2 head (here) and, by ``kind``, the EAGLE-3 head (:mod:`treedec.models.eagle3`).

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
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from treedec.attention import folded_sdpa, prefix_tree_mask
from treedec.models.cache import KVCache
from treedec.models.draft_config import BUNDLED_DRAFTS  # noqa: F401  (calibration imports it from here)
from treedec.models.draft_config import (DRAFT_CONFIG, DRAFT_WEIGHTS, KINDS, DraftConfig, head_dir,
                                         target_fingerprint)
from treedec.models.llama import (DecoderLayer, ModelOutput, Transformer, apply_rope, one_row_matmuls, rms_norm,
                                  rope_cos_sin, rope_inv_freq, rope_lookup, rope_table)
from treedec.models.packed import PackedLinear, pack_linears, packed_bf16_is_faster, packed_weight, should_pack
from treedec.models.quantized import QUANTIZE, Int8Linear, int8_is_faster, is_quantized, quantize_linears


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without dispatching an op when it already is (a draft pass has ~80 ops: each counts)."""
    return x if x.dtype == dtype else x.to(dtype)


def check_target(target: object) -> None:
    """A head binds to a loaded model: a name (``target="tiny-code"``) would fail deep inside binding, or later."""
    if target is not None and not isinstance(target, Transformer):
        raise TypeError(f"a draft head's target is a loaded model (treedec.models.load_model({target!r})), not "
                        f"{type(target).__name__} {target!r}")


def inference_dtype(target: Transformer | None, device=None) -> torch.dtype | None:
    """The head's dtype for ``dtype="auto"``: the target's on a GPU; on a CPU fp32, or for a bf16 target bf16
    (packed) where this CPU runs the head's few-row matmuls faster so.

    A head runs a handful of rows per matmul (a chain's one node, a catch-up's accepted tokens, a batch's rows),
    and which dtype is cheaper there is the machine's: on a Xeon with AMX oneDNN's bf16 call has a fixed
    ~20 us cost and fp32 is 2-5x cheaper; on an AMD EPYC (AVX-512 BF16, no AMX) fp32 beyond one row is 2-3x
    slower than packed bf16, and a bf16 head drafted 4-10 % faster at batches 1 and 4 (docs/benchmarks.md).
    So it is measured once per process on the head's shapes at 4 rows (:func:`packed_bf16_is_faster`). The
    head's inputs and outputs are cast at its boundaries either way.
    """
    dev = torch.device(device) if device is not None else target.device if target is not None else torch.device("cpu")
    if dev.type != "cpu":
        return target.dtype if target is not None else None
    if target is None or target.dtype != torch.bfloat16:
        return torch.float32
    return torch.bfloat16 if packed_bf16_is_faster(_head_shapes(target)) else torch.float32


def _head_shapes(target: Transformer) -> tuple[tuple[int, int], ...]:
    """(in, out) of a head's linears for ``target`` (the LM rows cut at 2048, a typical draft vocabulary)."""
    c = target.config
    H, qkv = c.hidden_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return (2 * H, H), (H, qkv), (H, 2 * c.intermediate_size), (c.intermediate_size, H), (H, min(c.vocab_size, 2048))


WIDE_ROWS = (8, 16, 32)  # the batch sizes tried, smallest first, for a head's bf16 twin (see wide_batch_rows)


def wide_batch_rows(target: Transformer) -> int | None:
    """The smallest batch of :data:`WIDE_ROWS` from which a head for this bf16 ``target`` drafts faster in packed
    bf16 than in fp32 on this CPU (None: at none of them; measured once per process and row count).

    :func:`inference_dtype` picks the head's dtype at 4 rows, a chain's pass at batch 4. A batch's pass holds one
    node per row, and oneDNN's fixed ~20 us a bf16 call is soon less than fp32's cost per row: on a Xeon with AMX,
    fp32 is 2-5x cheaper at 1-8 rows and 2x dearer at 16 (a 256->1408 projection 71 against 31 us), and a 5-deep
    chain at batch 16 ran 1.32x vanilla with an fp32 head, 1.49x with a bf16 one (docs/benchmarks.md).
    """
    if target.device.type != "cpu" or target.dtype != torch.bfloat16:
        return None
    return next((r for r in WIDE_ROWS if packed_bf16_is_faster(_head_shapes(target), r)), None)


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Visibility [T, (step+1)·T] of training-time-test step ``step`` over the keys of steps 0..step.

    Query t of step i stands for a depth-i draft node whose chain of ancestors is the step-j
    node at t-i+j (j = 1..i-1) under a root whose true-feature entries are positions <= t-i:
    exactly what the drafter's tree mask lets a depth-i node see at decode time.
    """
    t = torch.arange(T, device=device)
    blocks = [t[None, :] <= t[:, None] - step]  # step 0: the true-feature prefix
    blocks += [t[None, :] == t[:, None] - step + j for j in range(1, step + 1)]  # one ancestor per step
    return torch.cat(blocks, dim=1)


def ttt_attend(attn, x: torch.Tensor, cos, sin, keys: list, values: list, step: int) -> torch.Tensor:
    """Training-time-test step ``step``'s attention: queries of ``x`` over the keys of steps 0..step (this step's
    appended to ``keys``/``values``), through :func:`ttt_mask`; o_proj applied."""
    B, T, _ = x.shape
    q, k, v = attn._qkv(x, cos, sin)
    keys.append(k)
    values.append(v)
    kk, vv = torch.cat(keys, 2), torch.cat(values, 2)
    if attn.nkv != attn.nh:
        kk, vv = kk.repeat_interleave(attn.nh // attn.nkv, 1), vv.repeat_interleave(attn.nh // attn.nkv, 1)
    a = F.scaled_dot_product_attention(q, kk, vv, attn_mask=ttt_mask(T, step, x.device))
    return attn.o_proj(a.transpose(1, 2).reshape(B, T, attn.nh * attn.hd))


class DraftHead(nn.Module):
    """Trainable part of an EAGLE head; ``bind(target)`` attaches the shared embedding (and LM head).

    ``DraftHead(cfg)`` builds the class of ``cfg.kind``: this one for "eagle", an
    :class:`~treedec.models.eagle3.Eagle3Head` for "eagle3". A subclass registers its kind
    (``class Eagle3Head(DraftHead, kind="eagle3")``), so this module never imports the heads built on
    it; ``treedec/models/__init__.py`` imports them all.
    """

    _KINDS: dict[str, type] = {}

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
        self._wide: tuple = ()  # (its bf16 twin, the batch from which that drafts): see add_wide_twin

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
        if self._wide:
            self._wide[0].bind(target)
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

    def add_wide_twin(self, rows: int, dtype: torch.dtype = torch.bfloat16) -> "DraftHead":
        """Keep a copy of this head in ``dtype`` (packed on a CPU) that drafts for batches of ``rows`` rows or more
        (:meth:`for_batch`): a head's fastest dtype depends on how many rows its matmuls hold (:func:`wide_batch_rows`).
        The copy is not part of this module (its state dict and files are unchanged); a quantized head has none."""
        if is_quantized(self):
            raise ValueError("an int8 head (draft.quantize=int8) keeps no wide-batch twin: its dense linears serve wide "
                             "inputs already")
        twin = DraftHead(DraftConfig(**asdict(self.config)))
        twin.load_state_dict(self.state_dict())
        twin = twin.to(device=self.device, dtype=dtype).prepare(self.target if self._target else None)
        self._wide = (twin, int(rows))
        return self

    @property
    def wide_rows(self) -> int | None:
        """The batch from which :meth:`for_batch` drafts with the wide twin (None: the head has none)."""
        return self._wide[1] if self._wide else None

    def for_batch(self, rows: int) -> "DraftHead":
        """The head that drafts for a batch of ``rows`` rows: its wide twin from the twin's batch size on, else itself."""
        return self._wide[0] if self._wide and rows >= self._wide[1] else self

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
        x = torch.cat((_as(t.model.embed_tokens(tokens), dt), _as(features, dt)), dim=-1)
        mask, cos, sin = self._mask_rope(tokens.shape[1], cache, position_ids, mask)
        backend = "eager" if t.attn_backend == "eager" else "sdpa"  # one small layer: a dense mask is cheapest
        with one_row_matmuls(x, tokens.numel() == 1):  # a chain's node at batch 1: ATen's kernel, as the target's step
            return self.layer(self.fc(x), cos, sin, cache, 0, None, mask, backend)

    def forward_one(self, tokens: torch.Tensor, features: torch.Tensor, cache: KVCache, offset: int,
                    position_offset: int) -> torch.Tensor | None:
        """One node per row that sees its row's prefix and every input after it (a chain's next draft): tokens [B],
        features [B, H] -> predicted features [B, H]. Its key goes ``offset`` slots past each row's cached length (after
        the nodes drafted before it), its RoPE position is that length + ``position_offset``.

        :meth:`forward`'s maths without module calls or position tensors (and, over rows of one length, without a
        mask): a chain at batch 1 runs eight such passes a step, and on a CPU dispatch was ~40 % of each (~390 ->
        ~230 us a pass, docs/benchmarks.md). None where this head has no such path (another kind, unfused or
        q/k-normed projections, no RoPE table): the caller runs :meth:`forward`. The cache length does not move.
        """
        L = self.layer
        A, M = L.self_attn, L.mlp
        if type(self) is not DraftHead or not (A.fused and M.fused) or A.qk_norm:
            return None
        table = rope_table(self, self._n_positions, self.dtype)
        if table is None:
            return None
        cache.check_room(offset + 1)
        dt, B, host, last = self.dtype, tokens.shape[0], cache.host_lengths, table.shape[1] - 1
        emb = self.target.model.embed_tokens
        x = torch.cat((_as(F.embedding(tokens, emb.weight), dt), _as(features, dt)), dim=-1)
        if min(host) == max(host):  # one position, and every key up to the new one visible: no mask
            cs, mask = table.select(1, min(host[0] + position_offset, last)), None  # [2, D]
        else:  # (positions past the table clamped, as rope_lookup does: finished rows' outputs are never read)
            cs = table[:, (cache.lengths + position_offset).clamp(max=last)].unsqueeze(2)  # [2, B, 1, D]
            keys = torch.arange(max(host) + offset + 1, device=x.device)
            mask = (keys < (cache.lengths + (offset + 1))[:, None])[:, None, None]  # [B, 1, 1, S]
        nh, nkv = A.nh, A.nkv  # (narrow and select, not Python indexing: ~1 against ~4 us an op)
        with one_row_matmuls(x, B == 1):  # (.forward: a linear's own maths, without nn.Module's call machinery)
            x = self.fc.forward(x)
            qkv = A.qkv_proj.forward(x).view(B, nh + 2 * nkv, A.hd)
            qk = apply_rope(qkv.narrow(1, 0, nh + nkv), cs.select(0, 0), cs.select(0, 1))
            keys, values = cache.write(0, qk.narrow(1, nh, nkv).unsqueeze(2), qkv.narrow(1, nh + nkv, nkv).unsqueeze(2),
                                       offset)
            attn = folded_sdpa(qk.narrow(1, 0, nh).unsqueeze(2), keys, values, mask)  # K/V heads' queries as rows
            x = x + A.o_proj.forward(attn.reshape(B, nh * A.hd))
            norm = L.post_attention_layernorm
            gate, up = M.gate_up_proj.forward(rms_norm(x, norm.weight, norm.eps)).chunk(2, dim=-1)
            return x + M.down_proj.forward(F.silu(gate) * up)

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
            return self._lm_int8[0](_as(feat, self.dtype))
        if self._lm_packed is not None:
            return self._lm_packed(_as(feat, torch.bfloat16))
        w = self.target.lm_head.weight if self._lm_weight is None else self._lm_weight
        return torch.nn.functional.linear(_as(feat, w.dtype), w)

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
        """Training-time test for an EAGLE-1/2 head: (features, logits) of each of ``steps`` unrolled steps.

        Step 0 is :meth:`forward_train`. At decode time a depth-i draft reads its parent's *predicted*
        feature, never the target's; step i > 0 reads at position t the step-(i-1) prediction at t-1 and
        attends through :func:`ttt_mask` (what the drafter's tree mask shows a depth-i node), so the head
        learns to continue from its own features (HASS / EAGLE-3's training-time test). Positions t < i of
        step i have no parent: ignore them.
        """
        t, attn, layer = self.target, self.layer.self_attn, self.layer
        B, T = tokens.shape
        emb = t.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(torch.arange(T, device=tokens.device)[None].expand(B, T), self.inv_freq)
        feat, keys, values, out = features.to(self.dtype), [], [], []
        for i in range(steps):
            if i:
                feat = F.pad(feat[:, :-1], (0, 0, 1, 0))
            x = self.fc(torch.cat((emb, feat), dim=-1))
            x = x + ttt_attend(attn, layer.input_layernorm(x), cos, sin, keys, values, i)
            feat = x + layer.mlp(layer.post_attention_layernorm(x))
            out.append((feat, t.lm_head(feat.to(t.lm_head.weight.dtype))))
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str | Path) -> None:
        """Write draft_config.json + draft.safetensors; a bound head records its target's fingerprint."""
        from safetensors.torch import save_file

        from treedec.models.checkpoint import follow_umask

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

    @classmethod
    def load(cls, path: str | Path, target: Transformer | None = None, dtype=None, device=None,
             quantize: str | None = None) -> "DraftHead":
        """Load a bundled head ("tiny-code-eagle", "tiny-code-eagle3") or a directory (draft_config.json + draft.safetensors); never unpickles.

        ``dtype``: None keeps the file's; "auto" is :func:`inference_dtype` for the target; else a dtype or its name.
        ``quantize``: "int8" rounds the head's weights to int8 for its passes of few rows (:mod:`treedec.models.quantized`;
        the output does not change, the drafts only where the head's top tokens nearly tie); "auto": int8 on a CPU
        where that measures faster than the head's dtype (:func:`~treedec.models.quantized.int8_is_faster`); None keeps
        them.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        from treedec.models.checkpoint import check_finite

        check_target(target)
        if quantize is not None and quantize not in QUANTIZE:
            raise ValueError(f"draft.quantize={quantize!r} is not supported; use null (full precision), "
                             f"{' or '.join(QUANTIZE)}")

        auto = str(dtype) == "auto"
        dtype = inference_dtype(target, device) if auto else dtype
        if isinstance(dtype, str):
            from treedec.models.checkpoint import resolve_dtype

            dtype = resolve_dtype(dtype)
        path = head_dir(path)
        if not (path / DRAFT_CONFIG).is_file():  # config.json: EAGLE / EAGLE-3 / speculators
            from treedec.models.head_formats import load_published

            return _with_wide_twin(load_published(path, cls, target, dtype=dtype, device=device, quantize=quantize), auto)
        try:
            cfg = DraftConfig(**json.loads((path / DRAFT_CONFIG).read_text()))
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"corrupt {path / DRAFT_CONFIG}: {e}") from e
        head = cls(cfg)
        try:
            state = load_file(str(path / DRAFT_WEIGHTS))
        except (FileNotFoundError, SafetensorError, OSError) as e:
            raise ValueError(f"cannot read draft weights {path / DRAFT_WEIGHTS} ({e}); re-save or retrain the head") from e
        check_finite(path / DRAFT_WEIGHTS, state)
        try:
            missing, unexpected = head.load_state_dict(state, strict=False)
        except RuntimeError as e:  # a tensor whose shape does not fit the config
            raise ValueError(f"draft weights in {path} do not fit {DRAFT_CONFIG}: {e}") from e
        if missing or unexpected:
            raise ValueError(f"draft weights in {path} do not match its config: missing {missing}, unexpected {unexpected}")
        head = head.to(device=device or "cpu", dtype=dtype or state["fc.weight"].dtype)
        return _with_wide_twin(head.prepare(target, quantize), auto)

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


def _with_wide_twin(head: DraftHead, auto: bool) -> DraftHead:
    """``dtype="auto"``: an fp32 head bound to a bf16 CPU target gets a packed bf16 twin for the batches where that
    measures faster (:func:`wide_batch_rows`); any other head is returned as it is."""
    if auto and head._target and head.dtype == torch.float32 and not is_quantized(head):
        rows = wide_batch_rows(head.target)
        if rows is not None:
            head.add_wide_twin(rows)
    return head
