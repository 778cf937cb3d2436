"""One compact Llama-family transformer (Llama 2/3, Mistral, Qwen2, Qwen3) with tree-aware attention.

Every forward pass is "T new tokens after each row's cached prefix, arranged as a tree":
a prompt or a plain decoding step is simply a chain. Which attention backend runs and in which form the
tree's mask is built is decided once per forward by :mod:`treedec.attention.dispatch`, so the model only
embeds, rotates, runs its layers and projects, and the same code verifies a draft tree in one pass.
Parameter names follow Hugging Face's, so checkpoints load without renaming.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from treedec.attention import default_backend
from treedec.attention.dispatch import attend, check_tree, forward_mask
from treedec.models.cache import KVCache
from treedec.models.config import LlamaConfig
from treedec.models.fusable import Fusable
from treedec.models.packed import pack_linears


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation in fp32, cast back to x's dtype, then scaled (``transformers``' order of operations)."""
    xf = x if x.dtype == torch.float32 else x.float()  # (casts that would be no-ops are skipped: fewer ops)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf if x.dtype == torch.float32 else xf.to(x.dtype))


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3 ("llama3") or linear position scaling.

    Computed in fp32 with the same operations as ``transformers``, so that both agree bit for bit.
    """
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        mid = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = torch.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv.float()


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, D] for position ids [B, T]; sin with rotate-half's sign folded in (first half negated).

    The values are ``transformers``' (fp32, same operations); the sign makes :func:`apply_rope` one roll
    instead of chunk, neg and cat, with the same products bit for bit (negation is exact).
    """
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    sin, half = emb.sin(), inv_freq.shape[-1]
    return emb.cos(), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


ROPE_TABLE_BYTES = 64 << 20  # a longer context's cos/sin table is not kept: computed per forward instead
ROPE_TABLE_SLACK = 256  # table rows past the context (see rope_lookup)


def rope_lookup(owner: nn.Module, position_ids: torch.Tensor, n_positions: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_cos_sin` in ``dtype`` for ``owner``'s ``inv_freq``, as rows of a table of positions
    ``[0, n_positions)`` built once per device, dtype and size (bit for bit the same values).

    A forward then costs one index op instead of nine, ~30 us on a CPU, where a draft head's pass is
    ~0.3 ms. The table holds :data:`ROPE_TABLE_SLACK` positions past ``n_positions``, where padding columns and
    finished rows may sit near the end of the context; a position past those gets the last one's values
    (such a slot's outputs are never read), where an index past the table would fail (on a GPU, as a
    device-side assert).
    """
    table = rope_table(owner, n_positions, dtype)
    if table is None:
        cos, sin = rope_cos_sin(position_ids, owner.inv_freq)  # (a compiled graph folds this itself)
        return cos.to(dtype), sin.to(dtype)
    cs = table[:, position_ids.clamp(max=table.shape[1] - 1)]  # [2, B, T, D]
    return cs[0][:, None], cs[1][:, None]


def rope_table(owner: nn.Module, n_positions: int, dtype: torch.dtype) -> torch.Tensor | None:
    """:func:`rope_lookup`'s table [2 (cos, sin), n_positions + slack, D], made once per device, dtype and size; None
    where none is kept (inside a compiled graph, or above :data:`ROPE_TABLE_BYTES`)."""
    inv, n = owner.inv_freq, n_positions + ROPE_TABLE_SLACK
    if torch.compiler.is_compiling() or 2 * n * 2 * inv.numel() * dtype.itemsize > ROPE_TABLE_BYTES:
        return None
    key = (inv.device, dtype, inv.data_ptr(), n)
    table = getattr(owner, "_rope_table", None)
    if table is None or table[0] != key:
        cos, sin = rope_cos_sin(torch.arange(n, device=inv.device)[None], inv)
        table = owner._rope_table = (key, torch.stack((cos[0, 0], sin[0, 0])).to(dtype))  # [2, n, D]
    return table[1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B, 1, T, D] from :func:`rope_cos_sin` (rotate-half convention, as in HF Llama).

    ``sin`` must carry rotate-half's sign (:func:`rope_cos_sin`'s): an HF-convention sin gives wrong results silently.

    Computed in x's dtype with cos/sin rounded to it, exactly as ``transformers`` does, so that
    bf16 models decode the same tokens in both (cos/sin are computed in fp32 first).
    """
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


@contextmanager
def one_row_matmuls(x: torch.Tensor, one_row: bool):
    """Run a one-row forward (a decoding step of one sequence) with ATen's own bf16 matmuls on a CPU.

    oneDNN, which PyTorch uses for bf16 matmuls on CPUs, pays ~20 us per call whatever the size;
    for a single row ATen's kernel is 1.5-3x faster (a 12-layer step here: 4.1 -> 2.7 ms), for two
    rows or more oneDNN wins (docs/benchmarks.md). Both accumulate in fp32, but not in the same order: a result
    may differ by a bf16 rounding unit (as a tree pass and a one-token pass do anyway; greedy outputs part only at
    such ties, see the README). It flips a process-wide flag: not for concurrent forwards in threads.
    """
    if not (one_row and x.dtype == torch.bfloat16 and x.device.type == "cpu" and torch.backends.mkldnn.enabled):
        yield
        return
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = True


class Attention(Fusable):
    _fused, _parts = "qkv_proj", ("q_proj", "k_proj", "v_proj")

    def __init__(self, cfg: LlamaConfig, in_features: int | None = None):
        """``in_features``: q/k/v input width when it is not ``hidden_size`` (EAGLE-3's midlayer reads 2H)."""
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d_in = in_features or cfg.hidden_size
        self.q_proj = nn.Linear(d_in, self.nh * self.hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d_in, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d_in, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:  # Qwen3: each head's q and k RMS-normalised after the split, before RoPE
            self.q_norm, self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps), RMSNorm(self.hd, cfg.rms_norm_eps)
        self._init_hooks()

    def _qkv(self, x, cos, sin):
        B, T, _ = x.shape
        if self.fused and not self.qk_norm:  # rotate q and k heads together: one RoPE instead of two
            qkv = self.qkv_proj(x).view(B, T, self.nh + 2 * self.nkv, self.hd).transpose(1, 2)
            qk, v = qkv.split([self.nh + self.nkv, self.nkv], dim=1)
            q, k = apply_rope(qk, cos, sin).split([self.nh, self.nkv], dim=1)
            return q, k, v
        q, k, v = self._project(x)
        q = q.view(B, T, self.nh, self.hd).transpose(1, 2)
        k = k.view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.hd).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, cache: KVCache, layer: int, bits, mask, backend: str):
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        keys, values = cache.write(layer, k, v)
        out = attend(q, keys, values, cache.lengths, bits, mask, backend)  # (bits, mask, backend: forward_mask's)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def forward_causal(self, x, cos, sin):
        """Plain causal self-attention over ``x`` alone (no cache): the training path."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x, cos, sin)
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(Fusable):
    _fused, _parts = "gate_up_proj", ("gate_proj", "up_proj")

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(h, i, bias=b), nn.Linear(h, i, bias=b), nn.Linear(i, h, bias=b)
        self._init_hooks()

    def forward(self, x):
        gate, up = self._project(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn, self.mlp = Attention(cfg), MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, layer, bits, mask, backend):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, bits, mask, backend)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_causal(self, x, cos, sin):
        x = x + self.self_attn.forward_causal(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fuse(self) -> "DecoderLayer":
        """Fuse q/k/v and gate/up into single matmuls (in place; state-dict names unchanged)."""
        self.self_attn.fuse()
        self.mlp.fuse()
        return self


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, V] (or only the rows asked for)
    hidden: torch.Tensor  # final normed hidden state [B, T, H]: the LM head's input, EAGLE's feature
    layer_inputs: dict[int, torch.Tensor]  # inputs of the layers asked for (EAGLE-3-style fusion)


class Backbone(nn.Module):
    """HF's ``model.*`` submodule: embeddings, decoder layers, final norm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """A causal LM whose every forward may be a tree; ``attn_backend`` is eager | sdpa | triton | auto."""

    def __init__(self, cfg: LlamaConfig, attn_backend: str = "auto"):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.attn_backend = attn_backend
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def fuse(self) -> "Transformer":
        """Fuse every layer's q/k/v and gate/up projections (``load_model`` does it by default)."""
        for layer in self.model.layers:
            layer.fuse()
        return self

    def pack(self) -> "Transformer":
        """bf16 on a CPU: multiply by weights packed once for oneDNN (bit-identical, a copy of the linear
        weights; ``load_model`` does it for models up to 2 GiB of them: see :mod:`treedec.models.packed`)."""
        pack_linears(self)
        return self

    def backend(self) -> str:
        return default_backend(self.device) if self.attn_backend == "auto" else self.attn_backend

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> KVCache:
        c = self.config
        max_len = max_len or c.max_position_embeddings
        return KVCache(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim, self.dtype, self.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        position_ids: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        ancestor_bits: torch.Tensor | None = None,
        logits: str | torch.Tensor = "all",
        layer_inputs: tuple[int, ...] = (),
        inputs_embeds: torch.Tensor | None = None,
        for_compile: bool = False,
    ) -> ModelOutput:
        """Run T new tokens per row after the cached prefix; the cache length does not move.

        The tokens form a tree given by ``tree_mask``, a bool ancestry matrix [T, T] or [B, T, T]
        (``[i, j]`` iff j == i or j is an ancestor of i), or by its packed ``ancestor_bits``
        [(B,) T, W]; by default a chain. ``position_ids`` default to ``length + arange(T)``
        (checked against the context); given, they are trusted. ``logits`` is "all", "last",
        "none" or an index tensor of positions to project. Then call ``cache.advance`` or
        ``cache.commit``.

        No host reads: shapes come from ``cache.host_lengths`` and the mask is built once, in the
        backend's form (:func:`treedec.attention.dispatch.forward_mask`). ``for_compile=True``
        is the torch.compile path (:mod:`treedec.models.compile`): attention spans the whole cache
        (S = ``cache.max_len``, the mask from the device lengths), writes are device-side index ops and
        nothing depends on a Python-side length, so one graph serves every step of a given T; it uses a
        dense mask (sdpa, or eager when that is the backend) and does not check room or context.
        """
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = x.shape[:2]
        check_tree(tree_mask, ancestor_bits, B, T)
        host = None if for_compile else self._room(cache, T)
        position_ids = self._positions(position_ids, cache, x, host)
        c = self.config
        bits, mask, backend = forward_mask(self.backend(), x, cache.lengths, host, cache.max_len,
                                           (c.num_attention_heads, c.num_key_value_heads), tree_mask, ancestor_bits)
        cos, sin = rope_lookup(self, position_ids, c.max_position_embeddings, x.dtype)
        kv, saved = cache.static() if for_compile else cache, {}
        with one_row_matmuls(x, B * T == 1 and not for_compile):
            for i, layer in enumerate(self.model.layers):
                if i in layer_inputs:
                    saved[i] = x
                x = layer(x, cos, sin, kv, i, bits, mask, backend)
        if c.num_hidden_layers in layer_inputs:  # "the input of layer L": the last layer's output, before the norm
            saved[c.num_hidden_layers] = x
        h = self.model.norm(x)
        return ModelOutput(self._logits(h, logits), h, saved)

    @staticmethod
    def _room(cache: KVCache, T: int) -> list[int]:
        """The cache's host lengths, once it is checked to hold T more tokens in every row."""
        cache.check_room(T)
        return cache.host_lengths

    def _positions(self, position_ids: torch.Tensor | None, cache: KVCache, x: torch.Tensor,
                   host: list[int] | None) -> torch.Tensor:
        """Position ids [B, T] of the new tokens ``x`` [B, T, H]; a default one checked against the context where the
        host lengths are given (the compile path reads none)."""
        B, T = x.shape[:2]
        if position_ids is None:
            if host is not None and max(host) + T > self.config.context_length:
                raise ValueError(
                    f"position {max(host) + T - 1} is beyond the model's context of "
                    f"{self.config.context_length} tokens; shorten the prompt or max_new_tokens"
                )
            return cache.lengths[:, None] + torch.arange(T, device=x.device)
        return position_ids[None].expand(B, T) if position_ids.dim() == 1 else position_ids

    def _logits(self, h: torch.Tensor, which: str | torch.Tensor) -> torch.Tensor | None:
        """The LM head over ``h``'s positions: "all", "last", "none" (None) or an index tensor ([T] or [B, k]).

        It keeps oneDNN even for one row: at 8192 outputs its packed kernel is as fast as ATen's on one CPU
        (Xeon) and 3x faster on another (AMD EPYC, 70 vs 210 us; docs/benchmarks.md), same outputs.
        """
        if isinstance(which, str):
            return {"all": lambda: self.lm_head(h), "last": lambda: self.lm_head(h[:, -1:]), "none": lambda: None}[which]()
        rows = h[:, which] if which.dim() == 1 else h.gather(1, which[..., None].expand(-1, -1, h.shape[-1]))
        return self.lm_head(rows)

    def forward_train(self, input_ids: torch.Tensor, return_hidden: bool = False, layer_inputs: tuple[int, ...] = ()):
        """Logits [B, T, V] of a plain causal pass from position 0, without a KV cache (pretraining).

        The same function as :meth:`forward` on a fresh cache with the default chain (tested to
        fp32 precision), but with ``scaled_dot_product_attention(is_causal=True)``: no cache
        writes, no dense mask and no K/V kept, so autograd stores less. Used by
        :class:`treedec.training.lm.CausalLMModule`; :meth:`forward` is unchanged. With
        ``return_hidden`` it also returns the final normed hidden state (EAGLE's feature); with
        ``layer_inputs`` (layer ids) a :class:`ModelOutput` that also holds those layers' inputs (EAGLE-3's).
        """
        B, T = input_ids.shape
        if T > self.config.max_position_embeddings:
            raise ValueError(f"sequence of {T} tokens is beyond the model's context of "
                             f"{self.config.max_position_embeddings} tokens")
        x = self.model.embed_tokens(input_ids)
        pos = torch.arange(T, device=x.device)[None].expand(B, T)
        cos, sin = rope_cos_sin(pos, self.inv_freq)
        saved = {}
        for i, layer in enumerate(self.model.layers):
            if i in layer_inputs:
                saved[i] = x
            x = layer.forward_causal(x, cos, sin)
        if self.config.num_hidden_layers in layer_inputs:
            saved[self.config.num_hidden_layers] = x
        h = self.model.norm(x)
        if layer_inputs:
            return ModelOutput(self.lm_head(h), h, saved)
        return (self.lm_head(h), h) if return_hidden else self.lm_head(h)
