"""Published head layouts (EAGLE-1/2, EAGLE-3 / SpecForge, vLLM speculators, P-EAGLE) load through ``load_head``.

Each layout is written here from its published key names with random weights, and its draft
logits are checked against a reference forward of that layout written below in plain torch
from the raw state dict (not through treedec's modules).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tests.helpers import tiny_model
from treedec.heads import load_head
from treedec.models.checkpoint import CheckpointError

V, H, NH, NKV, FF = 97, 64, 4, 2, 112  # FF: the MLP width (intermediate_size)
HD = H // NH


# ------------------------------------------------------------------ the reference forwards (plain torch)
def rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, theta):
    T = x.shape[-2]
    inv = 1.0 / theta ** (torch.arange(0, HD, 2).float() / HD)
    ang = torch.arange(T).float()[:, None] * inv
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def ref_attn(sd, p, x, theta):
    T = x.shape[1]
    lin = lambda n: F.linear(x, sd[f"{p}self_attn.{n}_proj.weight"], sd.get(f"{p}self_attn.{n}_proj.bias"))
    q = lin("q").view(1, T, NH, HD).transpose(1, 2)
    k = lin("k").view(1, T, NKV, HD).transpose(1, 2).repeat_interleave(NH // NKV, 1)
    if f"{p}self_attn.q_norm.weight" in sd:  # Qwen3 layers: each head's q and k RMS-normed before RoPE
        q, k = rms(q, sd[f"{p}self_attn.q_norm.weight"]), rms(k, sd[f"{p}self_attn.k_norm.weight"])
    v = lin("v").view(1, T, NKV, HD).transpose(1, 2).repeat_interleave(NH // NKV, 1)
    s = rope(q, theta) @ rope(k, theta).transpose(-1, -2) / math.sqrt(HD)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = (s.softmax(-1) @ v).transpose(1, 2).reshape(1, T, NH * HD)
    return F.linear(out, sd[f"{p}self_attn.o_proj.weight"])


def ref_mlp(sd, p, x):
    g, u = (F.linear(x, sd[f"{p}mlp.{n}_proj.weight"]) for n in ("gate", "up"))
    return F.linear(F.silu(g) * u, sd[f"{p}mlp.down_proj.weight"])


def ref_eagle(sd, target, tokens, feats, theta=10000.0):
    """EAGLE-1/2: fc(cat(embed, feature)) -> layer without input norm -> the target's LM head."""
    x = F.linear(torch.cat((target.model.embed_tokens.weight[tokens], feats), -1), sd["fc.weight"], sd.get("fc.bias"))
    x = x + ref_attn(sd, "layers.0.", x, theta)
    x = x + ref_mlp(sd, "layers.0.", rms(x, sd["layers.0.post_attention_layernorm.weight"]))
    return x @ target.lm_head.weight.T


def ref_eagle3(sd, p, target, tokens, low_mid_high, theta=10000.0, norm_before_residual=False):
    """EAGLE-3: f = fc(cat(l, m, h)); attn(cat(input_norm(embed), hidden_norm(f))) + f; mlp; lm_head(norm).

    ``norm_before_residual`` (speculators): the residual around attention is hidden_norm(f) instead of f.
    """
    f = F.linear(low_mid_high, sd["fc.weight"])
    e = rms(target.model.embed_tokens.weight[tokens], sd[f"{p}input_layernorm.weight"])
    fn = rms(f, sd[f"{p}hidden_norm.weight"])
    x = (fn if norm_before_residual else f) + ref_attn(sd, p, torch.cat((e, fn), -1), theta)
    x = x + ref_mlp(sd, p, rms(x, sd[f"{p}post_attention_layernorm.weight"]))
    return rms(x, sd["norm.weight"]) @ sd["lm_head.weight"].T


# ------------------------------------------------------------------ published directories
def rnd(*shape, g, scale=0.08):
    return scale * torch.randn(*shape, generator=g)


def layer_sd(p, g, width, qkv_bias=False, eagle3=False, qk_norm=False):
    sd = {f"{p}self_attn.q_proj.weight": rnd(NH * HD, width, g=g), f"{p}self_attn.k_proj.weight": rnd(NKV * HD, width, g=g),
          f"{p}self_attn.v_proj.weight": rnd(NKV * HD, width, g=g), f"{p}self_attn.o_proj.weight": rnd(H, NH * HD, g=g),
          f"{p}mlp.gate_proj.weight": rnd(FF, H, g=g), f"{p}mlp.up_proj.weight": rnd(FF, H, g=g),
          f"{p}mlp.down_proj.weight": rnd(H, FF, g=g), f"{p}post_attention_layernorm.weight": 1 + rnd(H, g=g, scale=0.2)}
    if qkv_bias:
        sd.update({f"{p}self_attn.{n}_proj.bias": rnd(w, g=g, scale=0.1) for n, w in (("q", NH * HD), ("k", NKV * HD),
                                                                                       ("v", NKV * HD))})
    if eagle3:
        sd.update({f"{p}{n}.weight": 1 + rnd(H, g=g, scale=0.2) for n in ("input_layernorm", "hidden_norm")})
    if qk_norm:
        sd.update({f"{p}self_attn.{n}.weight": 1 + rnd(HD, g=g, scale=0.3) for n in ("q_norm", "k_norm")})
    return sd


def layer_cfg(**kw):
    return dict(hidden_size=H, intermediate_size=FF, num_attention_heads=NH, num_key_value_heads=NKV, vocab_size=V,
                max_position_embeddings=512, rms_norm_eps=1e-5, hidden_act="silu", num_hidden_layers=1, **kw)


def write(path, cfg, sd, bin_file=False):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if bin_file:
        torch.save(sd, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    return path


def eagle_dir(path, seed=0, bias=True, qwen2=False, bin_file=False, embed=None):
    g = torch.Generator().manual_seed(seed)
    sd = {"fc.weight": rnd(H, 2 * H, g=g), **layer_sd("layers.0.", g, H, qkv_bias=qwen2)}
    if bias:
        sd["fc.bias"] = rnd(H, g=g, scale=0.1)
    if embed is not None:
        sd["embed_tokens.weight"] = embed
    arch = "Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"
    cfg = layer_cfg(architectures=[arch], bias=bias, rope_theta=10000.0)
    return write(path, cfg, sd, bin_file), sd


def draft_vocab(K, seed):
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:K].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids, ids - torch.arange(K), t2d


def eagle3_dir(path, seed=0, prefix="midlayer.", K=40, speculators=False, qwen3=False, **cfg_kw):
    g = torch.Generator().manual_seed(seed)
    ids, d2t, t2d = draft_vocab(K, seed)
    sd = {"fc.weight": rnd(H, 3 * H, g=g), **layer_sd(prefix, g, 2 * H, eagle3=True, qk_norm=qwen3),
          "norm.weight": 1 + rnd(H, g=g, scale=0.2), "lm_head.weight": rnd(K, H, g=g, scale=0.3), "d2t": d2t, "t2d": t2d}
    if speculators:
        cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"], "draft_vocab_size": K,
               "norm_before_residual": False,
               "transformer_layer_config": layer_cfg(model_type="qwen3" if qwen3 else "llama", head_dim=HD),
               "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": "target"}}, **cfg_kw}
    else:  # EAGLE-3 / SpecForge: often no rope_theta at all
        cfg = layer_cfg(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=K, **cfg_kw)
    return write(path, cfg, sd), sd, ids


@pytest.fixture(scope="module")
def target():
    return tiny_model(seed=3, num_hidden_layers=2, rope_theta=1e6)  # theta 1e6: a head must not take the target's


@pytest.fixture(scope="module")
def deep_target():
    return tiny_model(seed=4, num_hidden_layers=8, rope_theta=1e6)  # EAGLE-3's defaults: layers [2, 4, 5]


def inputs(seed, T=11, width=H):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (1, T), generator=g), torch.randn(1, T, width, generator=g)


@torch.inference_mode()
def draft_logits(head, tokens, feats):
    T = tokens.shape[1]
    cache = head.new_cache(1, T)
    out = head(tokens, feats, cache, torch.arange(T)[None])
    return head.logits(out)


# ------------------------------------------------------------------ EAGLE-1/2
@pytest.mark.parametrize("variant", ["bias", "no_bias", "qwen2_bias", "bin"])
def test_published_eagle_matches_reference(variant, target, tmp_path):
    path, sd = eagle_dir(tmp_path / "h", seed=1, bias=variant != "no_bias", qwen2=variant == "qwen2_bias",
                         bin_file=variant == "bin")
    head = load_head(path, target=target)
    assert head.config.kind == "eagle" and head.config.rope_theta == 10000.0
    assert (head.fc.bias is None) == (variant == "no_bias")  # no bias: none at all, not a zero one
    assert head.layer.self_attn.qkv_proj.bias is not None if variant == "qwen2_bias" else \
        head.layer.self_attn.qkv_proj.bias is None
    tokens, feats = inputs(2)
    torch.testing.assert_close(draft_logits(head, tokens, feats), ref_eagle(sd, target, tokens, feats),
                               atol=1e-4, rtol=1e-4)


def test_fc_bias_matters(target, tmp_path):
    """The bias really is applied: dropping it from the reference changes the logits."""
    path, sd = eagle_dir(tmp_path / "h", seed=5)
    tokens, feats = inputs(3)
    got = draft_logits(load_head(path, target=target), tokens, feats)
    assert (got - ref_eagle({**sd, "fc.bias": torch.zeros(H)}, target, tokens, feats)).abs().max() > 1e-3


def test_embedding_copy_is_checked(target, tmp_path):
    eagle_dir(tmp_path / "same", embed=target.model.embed_tokens.weight.detach().clone())
    load_head(tmp_path / "same", target=target)  # equal to the target's: silent
    eagle_dir(tmp_path / "other", embed=torch.randn(V, H))
    with pytest.warns(UserWarning, match="embedding that differs"):
        load_head(tmp_path / "other", target=target)


# ------------------------------------------------------------------ EAGLE-3 / SpecForge / speculators
@pytest.mark.parametrize("layout", ["midlayer", "layers0", "speculators", "speculators_nbr", "speculators_qwen3"])
def test_published_eagle3_matches_reference(layout, deep_target, tmp_path):
    prefix = "midlayer." if layout == "midlayer" else "layers.0."
    spec = layout.startswith("speculators")
    nbr = layout == "speculators_nbr"  # norm_before_residual, as RedHatAI's speculators heads are trained
    kw = dict(eagle_aux_hidden_state_layer_ids=[1, 3, 6], norm_before_residual=nbr, qwen3=layout.endswith("qwen3")) \
        if spec else {}
    path, sd, ids = eagle3_dir(tmp_path / "h", seed=6, prefix=prefix, speculators=spec, **kw)
    head = load_head(path, target=deep_target)
    c = head.config
    assert c.kind == "eagle3" and c.rope_theta == 10000.0 and c.draft_vocab_size == 40
    assert c.feature_layers == ([1, 3, 6] if spec else [2, 4, 5]) and c.norm_before_residual == nbr
    assert c.qk_norm == layout.endswith("qwen3")
    assert torch.equal(head.vocab_ids.cpu(), ids)
    tokens, low_mid_high = inputs(7, width=3 * H)
    with torch.inference_mode():
        got = draft_logits(head, tokens, head.project(low_mid_high))
    want = ref_eagle3(sd, prefix, deep_target, tokens, low_mid_high, norm_before_residual=nbr)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    if spec:  # the two residual rules really differ
        other = ref_eagle3(sd, prefix, deep_target, tokens, low_mid_high, norm_before_residual=not nbr)
        assert (other - want).abs().max() > 1e-3
    assert torch.equal(head.to_target_ids(got.argmax(-1)), want.argmax(-1) + sd["d2t"][want.argmax(-1)])


def test_eagle3_rope_is_the_heads_own(deep_target, tmp_path):
    path, sd, _ = eagle3_dir(tmp_path / "h", seed=8, rope_theta=5e5)
    head = load_head(path, target=deep_target)
    assert head.config.rope_theta == 5e5
    tokens, lmh = inputs(9, width=3 * H)
    with torch.inference_mode():
        got = draft_logits(head, tokens, head.project(lmh))
    torch.testing.assert_close(got, ref_eagle3(sd, "midlayer.", deep_target, tokens, lmh, theta=5e5), atol=1e-4, rtol=1e-4)
    assert (got - ref_eagle3(sd, "midlayer.", deep_target, tokens, lmh)).abs().max() > 1e-4


# ------------------------------------------------------------------ errors
def test_wrong_hidden_size_names_both(tmp_path):
    path, _ = eagle_dir(tmp_path / "h")
    small = tiny_model(seed=0, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"hidden 64.*does not fit.*hidden 32"):
        load_head(path, target=small)


def test_wrong_vocab_names_both(tmp_path):
    path, _ = eagle_dir(tmp_path / "h")
    with pytest.raises(ValueError, match=r"vocab 97.*vocab 50"):
        load_head(path, target=tiny_model(seed=0, vocab_size=50))


def test_layer_ids_beyond_the_target(target, deep_target, tmp_path):
    path, _, _ = eagle3_dir(tmp_path / "ids", speculators=True, eagle_aux_hidden_state_layer_ids=[2, 4, 9])
    with pytest.raises(ValueError, match=r"reads target layers \[2, 4, 9\].*8 layers"):
        load_head(path, target=deep_target)
    path, _, _ = eagle3_dir(tmp_path / "default")
    with pytest.raises(ValueError, match="load it with its target"):
        load_head(path)  # EAGLE-3's default layers need the target's depth


def test_pickle_only_file_refused(tmp_path):
    path, sd = eagle_dir(tmp_path / "h", bin_file=True)
    torch.save({**sd, "extra": Unpicklable()}, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="never unpickles"):
        load_head(path)
    (path / "pytorch_model.bin").rename(path / "model.pt")
    with pytest.raises(FileNotFoundError, match="model.pt"):
        load_head(path)


class Unpicklable:
    """A class instance in a weights file: what ``weights_only`` must refuse."""


def test_missing_and_unexpected_keys_listed(target, tmp_path):
    path, sd = eagle_dir(tmp_path / "missing")
    save_file({k: v for k, v in sd.items() if "down_proj" not in k}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing \['layer.mlp.down_proj.weight'\]"):
        load_head(path, target=target)
    path, sd = eagle_dir(tmp_path / "bias", bias=False)
    save_file({**sd, "fc.bias": torch.zeros(H)}, str(path / "model.safetensors"))  # config says "bias": false
    with pytest.raises(ValueError, match=r"unexpected tensors \['fc.bias'\]"):
        load_head(path, target=target)


def test_t2d_must_agree_with_d2t(deep_target, tmp_path):
    path, sd, _ = eagle3_dir(tmp_path / "h")
    t2d = sd["t2d"].clone()
    t2d[int((~t2d).nonzero()[0])] = True
    save_file({**sd, "t2d": t2d}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="t2d"):
        load_head(path, target=deep_target)


def test_target_directory_is_not_a_head(tmp_path):
    from treedec.models.checkpoint import save_pretrained

    save_pretrained(tiny_model(seed=0), tmp_path)
    with pytest.raises(ValueError, match="2-layer model, not a 1-layer EAGLE head"):
        load_head(tmp_path)


@pytest.mark.parametrize("change,needle", [
    (dict(speculators_model_type="eagle"), "'eagle3' and 'peagle' heads only"),
    (dict(target_hidden_size=2 * H), "target_hidden_size"),
])
def test_unsupported_variants_are_named(change, needle, deep_target, tmp_path):
    path, _, _ = eagle3_dir(tmp_path / "h", speculators=True)
    cfg = {**json.loads((path / "config.json").read_text()), **change}
    (path / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    with pytest.raises(ValueError, match=needle):
        load_head(path, target=deep_target)


def test_speculators_norm_before_residual_defaults_to_vllms(deep_target, tmp_path):
    path, _, _ = eagle3_dir(tmp_path / "h", speculators=True, eagle_aux_hidden_state_layer_ids=[1, 3, 6])
    cfg = json.loads((path / "config.json").read_text())
    del cfg["norm_before_residual"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_head(path, target=deep_target).config.norm_before_residual  # as vLLM reads such a config


# ------------------------------------------------------------------ malformed published heads (issue 39)
def _edit_cfg(path, **change):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))


def _resave(path, sd, **change):
    save_file({k: v.contiguous() for k, v in {**sd, **change}.items()}, str(path / "model.safetensors"))


def _as_index(path, index_text):
    (path / "model.safetensors").rename(path / "model-00001-of-00001.safetensors")
    (path / "model.safetensors.index.json").write_text(index_text)


MALFORMED = {  # name: (eagle3 layout?, how the written directory is spoiled, what the one-line error says)
    "d2t_2d": (True, lambda p, sd: _resave(p, sd, d2t=sd["d2t"][None]), r"d2t has shape \(1, 40\).*\(40,\)"),
    "d2t_length": (True, lambda p, sd: _resave(p, sd, d2t=sd["d2t"][:39]), r"d2t has shape \(39,\)"),
    "draft_vocab_vs_lm_head": (True, lambda p, sd: _edit_cfg(p, draft_vocab_size=39),
                               r"draft_vocab_size is 39, but the weights say 40 \(lm_head.weight has shape \(40, "),
    "string_layers": (False, lambda p, sd: _edit_cfg(p, num_hidden_layers="1"),
                      r"\"num_hidden_layers\" is '1', not an integer: write it as the JSON integer 1"),
    "hidden_vs_fc": (False, lambda p, sd: _edit_cfg(p, hidden_size=128),
                     r"hidden_size is 128, but the weights say 64 \(fc.weight has shape \(64, 128\)\)"),
    "float_layer_ids": (True, lambda p, sd: _edit_cfg(p, eagle_aux_hidden_state_layer_ids=[2.7, 4, 5]),
                        r"layer ids must be integers.*2\.7"),
    "string_layer_ids": (True, lambda p, sd: _edit_cfg(p, eagle_aux_hidden_state_layer_ids=["2", "4", "5"]),
                         r"layer ids must be integers.*'2'"),
    "list_config": (False, lambda p, sd: (p / "config.json").write_text("[1, 2]"), "not a JSON object"),
    "index_without_weight_map": (False, lambda p, sd: _as_index(p, '{"metadata": {}}'), "weight_map"),
    "index_not_json": (False, lambda p, sd: _as_index(p, '{"weight_map": '), "index"),
    "index_map_is_a_list": (False, lambda p, sd: _as_index(p, '{"weight_map": ["a"]}'), "weight_map"),
    "bias_string": (False, lambda p, sd: _edit_cfg(p, bias="false"), r'"bias" must be true or false.*\'false\''),
    "gpt2": (False, lambda p, sd: _edit_cfg(p, architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_heads_name_path_and_problem(case, target, deep_target, tmp_path):
    eagle3, spoil, needle = MALFORMED[case]
    if eagle3:
        path, sd, _ = eagle3_dir(tmp_path / "h", eagle_aux_hidden_state_layer_ids=[2, 4, 5])
    else:
        path, sd = eagle_dir(tmp_path / "h")
    spoil(path, sd)
    with pytest.raises(ValueError, match=needle) as err:
        load_head(path, target=deep_target if eagle3 else target)
    msg = str(err.value)
    assert str(path) in msg and "\n" not in msg, msg


def _bin_dir(path, payload: bytes):
    eagle_dir(path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(payload)
    return path


@pytest.mark.parametrize("damage", ["truncated", "random", "empty"])
def test_corrupt_bin_says_corrupt(damage, tmp_path):
    import io
    import os

    buf = io.BytesIO()
    torch.save({"fc.weight": torch.ones(H, 2 * H)}, buf)
    good = buf.getvalue()
    payload = {"truncated": good[: len(good) // 2], "random": os.urandom(300), "empty": b""}[damage]
    path = _bin_dir(tmp_path / "h", payload)
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin is corrupt") as err:
        load_head(path)
    assert "more than plain tensors" not in str(err.value) and "\n" not in str(err.value)


class RunsCode:
    """A pickle that would run ``os.system`` when unpickled."""

    def __reduce__(self):
        import os

        return os.system, ("echo unpickled",)


@pytest.mark.parametrize("how", ["torch_save", "raw_pickle"])
def test_malicious_bin_is_refused_naming_the_global(how, tmp_path):
    import io
    import pickle

    if how == "torch_save":
        buf = io.BytesIO()
        torch.save({"fc.weight": torch.ones(2), "x": RunsCode()}, buf)
        payload = buf.getvalue()
    else:
        payload = pickle.dumps({"x": RunsCode()}, protocol=4)
    path = _bin_dir(tmp_path / "h", payload)
    with pytest.raises(CheckpointError, match=r"refused.*posix\.system.*could run code") as err:
        load_head(path)
    msg = str(err.value)
    assert "weights_only=False" not in msg and "corrupt" not in msg and "\n" not in msg, msg


@pytest.mark.parametrize("where", ["safetensors", "bin"])
def test_non_finite_published_weights_are_refused(where, target, tmp_path):
    path, sd = eagle_dir(tmp_path / "h", bin_file=where == "bin")
    bad = sd["layers.0.mlp.up_proj.weight"].clone()
    bad[3, 5] = float("nan")
    if where == "bin":
        torch.save({**sd, "layers.0.mlp.up_proj.weight": bad}, path / "pytorch_model.bin")
    else:
        _resave(path, sd, **{"layers.0.mlp.up_proj.weight": bad})
    with pytest.raises(CheckpointError, match=r"h/(model.safetensors|pytorch_model.bin).*'layers.0.mlp.up_proj.weight'"
                                              r".*NaN or Inf"):
        load_head(path, target=target)


# ------------------------------------------------------------------ P-EAGLE (vLLM flat and speculators dialects)
def ref_peagle(sd, p, table, tokens, low_mid_high, mask_id, K, norm_before_residual, layers=None):
    """P-EAGLE as vLLM runs it, in the checkpoint's own convention: after the T verified pairs, K - 1 mask positions
    read the mask token's row of ``table`` and the pre-fc ``mask_hidden`` (3H), at positions T..T+K-2, causal, through
    layer 0 (the EAGLE-3 midlayer under ``p``), then the plain Llama layers ``layers.1..`` (``layers``: how many in
    all; None: every one ``sd`` holds). Draft logits [1, K, Kd] of depths 1..K (the last verified position, then the
    mask positions)."""
    T = tokens.shape[1]
    emb = torch.cat((table[tokens], table[mask_id].expand(1, K - 1, H)), 1)
    f = F.linear(torch.cat((low_mid_high, sd["mask_hidden"].reshape(1, 1, -1).expand(1, K - 1, -1)), 1), sd["fc.weight"])
    fn = rms(f, sd[f"{p}hidden_norm.weight"])
    x = (fn if norm_before_residual else f) + ref_attn(sd, p, torch.cat((rms(emb, sd[f"{p}input_layernorm.weight"]), fn),
                                                                         -1), 10000.0)
    x = x + ref_mlp(sd, p, rms(x, sd[f"{p}post_attention_layernorm.weight"]))
    i = 1
    while f"layers.{i}.input_layernorm.weight" in sd and (layers is None or i < layers):
        q = f"layers.{i}."
        x = x + ref_attn(sd, q, rms(x, sd[q + "input_layernorm.weight"]), 10000.0)
        x = x + ref_mlp(sd, q, rms(x, sd[q + "post_attention_layernorm.weight"]))
        i += 1
    return (rms(x, sd["norm.weight"]) @ sd["lm_head.weight"].T)[:, T - 1:]


MASK_ID, BLOCK = 91, 4


def peagle_dir(path, target, dialect="vllm", seed=10, prefix=None, own_embed=True, layers=1, unused_hidden_norm=False,
               **cfg_kw):
    """A P-EAGLE head as the published code writes it: EAGLE-3 tensors + ``mask_hidden`` [1, 1, 3H] + (trained)
    ``embed_tokens`` (here the target's table with a mask row of its own), and the dialect's config keys. ``layers``
    > 1: plain Llama layers ``layers.1..`` after the midlayer (amazon/GPT-OSS-20B-P-EAGLE has 4), each with an
    unused ``hidden_norm`` with ``unused_hidden_norm`` (vLLM builds one in every layer)."""
    g = torch.Generator().manual_seed(seed)
    prefix = prefix or ("midlayer." if dialect == "vllm" else "layers.0.")
    ids, d2t, t2d = draft_vocab(40, seed)
    sd = {"fc.weight": rnd(H, 3 * H, g=g), **layer_sd(prefix, g, 2 * H, eagle3=True), "norm.weight": 1 + rnd(H, g=g, scale=0.2),
          "lm_head.weight": rnd(40, H, g=g, scale=0.3), "d2t": d2t, "t2d": t2d, "mask_hidden": rnd(1, 1, 3 * H, g=g, scale=1.0)}
    if own_embed:
        sd["embed_tokens.weight"] = target.model.embed_tokens.weight.detach().clone()
        sd["embed_tokens.weight"][MASK_ID] = rnd(H, g=g, scale=1.0)
    for i in range(1, layers):  # the plain layers after the fused one
        sd.update(layer_sd(f"layers.{i}.", g, H))
        sd[f"layers.{i}.input_layernorm.weight"] = 1 + rnd(H, g=g, scale=0.2)
        if unused_hidden_norm:
            sd[f"layers.{i}.hidden_norm.weight"] = 1 + rnd(H, g=g, scale=0.2)
    common = dict(draft_vocab_size=40, eagle_aux_hidden_state_layer_ids=[1, 3, 6])
    if dialect == "vllm":
        cfg = {**layer_cfg(architectures=["LlamaForCausalLMEagle3"], ptd_token_id=MASK_ID, num_speculative_tokens=BLOCK,
                           **common), "num_hidden_layers": layers}
    else:
        cfg = {"speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"], "mask_token_id": MASK_ID,
               "norm_before_residual": True, "embed_requires_grad": True, **common,
               "transformer_layer_config": {**layer_cfg(model_type="llama", head_dim=HD), "num_hidden_layers": layers},
               "speculators_config": {"algorithm": "peagle", "default_proposal_method": "greedy", "verifier": {"name_or_path": "t"},
                                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK}]}}
    cfg.update(cfg_kw)
    return write(path, {k: v for k, v in cfg.items() if v is not None}, sd), sd


def peagle_marginals(head, tokens, low_mid_high, K):
    from treedec.decoding.drafter import Drafter

    with torch.inference_mode():
        d = Drafter(head, 1, 64)
        d.catch_up(tokens, low_mid_high, None, [tokens.shape[1]], tokens[:, -1])
        return d.marginals(K)


@pytest.mark.parametrize("case", ["vllm_ptd", "vllm_pard_layers0", "vllm_mask_hidden_h", "speculators",
                                  "speculators_no_embed"])
def test_published_peagle_matches_reference(case, deep_target, tmp_path):
    spec = case.startswith("speculators")
    kw = dict(dialect="speculators" if spec else "vllm", own_embed=case != "speculators_no_embed")
    if case == "vllm_pard_layers0":  # newer vLLM's key, a P-EAGLE architecture name, layers.0.*
        kw.update(prefix="layers.0.", ptd_token_id=None, pard_token=MASK_ID, architectures=["PeagleLlamaForCausalLM"])
    path, sd = peagle_dir(tmp_path / "h", deep_target, **kw)
    if case == "vllm_mask_hidden_h":  # already in the H space (vLLM's buffer without aux hidden states): used as is
        _resave(path, sd, mask_hidden=F.linear(sd["mask_hidden"], sd["fc.weight"]))
    p = "layers.0." if spec or case == "vllm_pard_layers0" else "midlayer."
    head = load_head(path, target=deep_target)
    c = head.config
    assert c.kind == "parallel" and c.block_size == BLOCK and c.norm_before_residual == spec
    assert c.feature_layers == [1, 3, 6] and c.draft_vocab_size == 40
    table = sd.get("embed_tokens.weight", deep_target.model.embed_tokens.weight.detach())
    tokens, lmh = inputs(11, width=3 * H)
    got = peagle_marginals(head, tokens, lmh, BLOCK)
    want = ref_peagle(sd, p, table, tokens, lmh, MASK_ID, BLOCK, spec)
    assert got.shape == want.shape == (1, BLOCK, 40)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    other = deep_target.model.embed_tokens.weight.detach() if case != "speculators_no_embed" else torch.randn(V, H)
    assert (ref_peagle(sd, p, other, tokens, lmh, MASK_ID, BLOCK, spec) - want)[:, 1:].abs().max() > 1e-3  # the row counts
    assert (ref_peagle(sd, p, table, tokens, lmh, MASK_ID, BLOCK, not spec) - want).abs().max() > 1e-3


def test_peagle_trained_embedding_is_checked_against_the_targets(deep_target, tmp_path):
    path, sd = peagle_dir(tmp_path / "h", deep_target)
    _resave(path, sd, **{"embed_tokens.weight": torch.randn(V, H)})
    with pytest.warns(UserWarning, match="embedding that differs"):
        load_head(path, target=deep_target)


def _one_line_error(path, target=None):
    with pytest.raises(ValueError) as err:
        load_head(path, target=target)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("case", ["vllm_midlayer", "vllm_layers0_hidden_norms", "vllm_config_silent",
                                  "speculators_layers0", "speculators_midlayer"])
def test_multi_layer_peagle_matches_reference(case, deep_target, tmp_path):
    """A 4-layer P-EAGLE drafter (the midlayer, then 3 plain Llama layers): its drafter marginals of depths 1..K are a
    plain-torch forward of the raw checkpoint through all four layers."""
    dialect, p = case.split("_")[0], "midlayer." if "midlayer" in case else "layers.0."
    path, sd = peagle_dir(tmp_path / "h", deep_target, dialect=dialect, prefix=p, layers=4,
                          unused_hidden_norm=case == "vllm_layers0_hidden_norms")
    if case == "vllm_config_silent":  # no num_hidden_layers: the tensors layers.1..3 tell
        _edit_cfg(path, num_hidden_layers=None)
    head = load_head(path, target=deep_target)
    c = head.config
    assert (c.kind, c.draft_layers, c.block_size, c.norm_before_residual) == ("parallel", 4, BLOCK, dialect != "vllm")
    tokens, lmh = inputs(12, width=3 * H)
    got = peagle_marginals(head, tokens, lmh, BLOCK)
    want = ref_peagle(sd, p, sd["embed_tokens.weight"], tokens, lmh, MASK_ID, BLOCK, dialect != "vllm")
    assert got.shape == want.shape == (1, BLOCK, 40)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for n in (1, 3):  # every layer counts
        short = ref_peagle(sd, p, sd["embed_tokens.weight"], tokens, lmh, MASK_ID, BLOCK, dialect != "vllm", layers=n)
        assert (short - want).abs().max() > 1e-3


@pytest.mark.parametrize("case", ["no_layer_2", "config_says_3", "speculators_config_says_5", "silent_no_layer_2",
                                  "layer_2_reads_2h", "layer_2_lacks_up_proj", "layer_3_extra", "layer_0_twice"])
def test_malformed_multi_layer_peagle_names_what_differs(case, deep_target, tmp_path):
    dialect = "speculators" if case.startswith("speculators") else "vllm"
    path, sd = peagle_dir(tmp_path / "h", deep_target, dialect=dialect, layers=4)
    cj, mid = path / "config.json", "midlayer.*" if dialect == "vllm" else "layers.0.*"
    if case in ("no_layer_2", "silent_no_layer_2"):
        _resave(path, {k: v for k, v in sd.items() if not k.startswith("layers.2.")})
    if case == "silent_no_layer_2":
        _edit_cfg(path, num_hidden_layers=None)
    if case == "config_says_3":
        _edit_layer_cfg(path, num_hidden_layers=3)
    if case == "speculators_config_says_5":
        _edit_layer_cfg(path, num_hidden_layers=5)
    if case == "layer_2_reads_2h":
        _resave(path, sd, **{"layers.2.self_attn.q_proj.weight": rnd(NH * HD, 2 * H, g=torch.Generator())})
    if case == "layer_2_lacks_up_proj":
        _resave(path, {k: v for k, v in sd.items() if k != "layers.2.mlp.up_proj.weight"})
    if case == "layer_3_extra":
        _resave(path, sd, **{"layers.3.self_attn.extra.weight": torch.zeros(1)})
    if case == "layer_0_twice":
        _resave(path, sd, **{"layers.0." + k[len("midlayer."):]: v.clone() for k, v in sd.items()
                             if k.startswith("midlayer.")})
    fix = ": a P-EAGLE drafter's layers are 0 (midlayer.* or layers.0.*) to N-1 (layers.{N-1}.*); correct config.json, " \
          "or fetch the whole checkpoint"
    want = {
        "no_layer_2": f"{cj}: \"num_hidden_layers\" is 4, but the weights hold midlayer.*, layers.1.*, layers.3.* "
                      f"(no layers.2.*){fix}",
        "silent_no_layer_2": f"{cj}: \"num_hidden_layers\" is absent and the weights hold midlayer.*, layers.1.*, "
                             f"layers.3.* (no layers.2.*){fix}",
        "config_says_3": f"{cj}: \"num_hidden_layers\" is 3, but the weights hold midlayer.*, layers.1.*, layers.2.*, "
                         f"layers.3.*{fix}",
        "speculators_config_says_5": f"{cj}: \"transformer_layer_config.num_hidden_layers\" is 5, but the weights hold "
                                     f"{mid}, layers.1.*, layers.2.*, layers.3.* (no layers.4.*){fix}",
        "layer_2_reads_2h": f"{path}: layers.2.self_attn.q_proj.weight has shape ({NH * HD}, {2 * H}): a P-EAGLE layer "
                            f"after the first reads the hidden state ({H} wide), not {2 * H}; treedec serves drafters "
                            "whose layers 1.. are plain Llama layers",
        "layer_2_lacks_up_proj": f"{path} (peagle layout): missing tensors ['layers.2.mlp.up_proj.weight']; layer 2 of "
                                 "a P-EAGLE drafter is a whole Llama decoder layer: fetch the whole checkpoint",
    }
    msg = _one_line_error(path, deep_target)
    if case in ("layer_0_twice", "layer_3_extra"):  # (layer 0 under midlayer.* and layers.0.*: one is left over)
        assert msg.startswith(f"{path} (peagle layout): unexpected tensors ['layers.{case[6]}.")
    else:
        assert msg == want[case]


DFLASH_BLOCK = 6  # z-lab's block_size: the root and 5 drafted depths


def dflash_dir(path, how="zlab", seed=20, n_ctx=3, **cfg_kw):
    """A DFlash drafter as z-lab publishes it: 2 Qwen3 layers (q/k norms), fc over 3 target layers' outputs,
    hidden_norm, norm, no embedding and no LM head."""
    g = torch.Generator().manual_seed(seed)
    sd = {"fc.weight": rnd(H, n_ctx * H, g=g), "hidden_norm.weight": 1 + rnd(H, g=g, scale=0.2),
          "norm.weight": 1 + rnd(H, g=g, scale=0.2)}
    for i in (0, 1):
        sd.update(layer_sd(f"layers.{i}.", g, H, qk_norm=True))
        sd[f"layers.{i}.input_layernorm.weight"] = 1 + rnd(H, g=g, scale=0.2)
    if how == "speculators":
        cfg = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"], "block_size": 16,
               "mask_token_id": MASK_ID, "transformer_layer_config": layer_cfg(model_type="qwen3", head_dim=HD)}
    elif how == "tensors":  # a config that says nothing: the tensors tell (a top-level hidden_norm, no lm_head)
        cfg = layer_cfg(architectures=["LlamaForCausalLM"])
    else:
        cfg = {**layer_cfg(model_type="qwen3", head_dim=HD, rope_theta=1e5), "num_hidden_layers": 2,
               "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
               "block_size": DFLASH_BLOCK, "num_target_layers": 8,
               "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3, 5]},
               "layer_types": ["full_attention"] * 2}
    if how == "model_prefix":  # (some exports keep HF's model. prefix)
        sd = {"model." + k: v for k, v in sd.items()}
    cfg.update(cfg_kw)
    return write(path, {k: v for k, v in cfg.items() if v is not None}, sd), sd


def rope_at(x, pos, theta):
    inv = 1.0 / theta ** (torch.arange(0, HD, 2).float() / HD)
    ang = pos.float()[:, None] * inv
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def ref_dflash(sd, target, prompt, root, layer_ids, mask_id, B, theta=1e5):
    """z-lab's DFlash forward from the raw tensors: context = hidden_norm(fc(cat of the target's layer *outputs*)); the
    block [root, mask x (B-1)] at positions P..P+B-1; every layer's keys/values are those of cat(context, block)
    (k_norm and RoPE on both), queries the block's, no mask; logits = target LM head(norm(out)) at block 1..B-1."""
    with torch.no_grad():
        P = prompt.shape[1]
        outs = target.forward_train(prompt, layer_inputs=tuple(i + 1 for i in layer_ids)).layer_inputs
        ctx = rms(F.linear(torch.cat([outs[i + 1] for i in layer_ids], -1), sd["fc.weight"]), sd["hidden_norm.weight"])
        emb = target.model.embed_tokens.weight
        x = torch.cat([emb[root][None, None], emb[mask_id].expand(1, B - 1, H)], 1)
        pos_q, pos_k = torch.arange(P, P + B), torch.arange(P + B)
        heads = lambda t, n: t.view(1, -1, n, HD).transpose(1, 2)
        for i in range(2):
            p = f"layers.{i}."
            h = rms(x, sd[p + "input_layernorm.weight"])
            lin = lambda n, t, p=p: F.linear(t, sd[f"{p}self_attn.{n}_proj.weight"])
            q = rope_at(rms(heads(lin("q", h), NH), sd[p + "self_attn.q_norm.weight"]), pos_q, theta)
            kv_in = torch.cat([ctx, h], 1)
            k = rope_at(rms(heads(lin("k", kv_in), NKV), sd[p + "self_attn.k_norm.weight"]), pos_k, theta)
            v = heads(lin("v", kv_in), NKV)
            k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
            a = ((q @ k.transpose(-1, -2) / math.sqrt(HD)).softmax(-1) @ v).transpose(1, 2).reshape(1, B, NH * HD)
            x = x + F.linear(a, sd[p + "self_attn.o_proj.weight"])
            x = x + ref_mlp(sd, p, rms(x, sd[p + "post_attention_layernorm.weight"]))
        return rms(x, sd["norm.weight"])[:, 1:] @ target.lm_head.weight.T


def dflash_marginals(head, target, prompt, root, depth):
    from treedec.decoding.drafter import Drafter

    with torch.inference_mode():
        out = target.forward_train(prompt, layer_inputs=head.feature_layers_needed)
        d = Drafter(head, 1, 64)
        nxt = torch.cat([prompt[:, 1:], root.view(1, 1)], 1)
        d.catch_up(nxt, head.features(out), None, [prompt.shape[1]], root.view(1))
        return d.marginals(depth)


@pytest.mark.parametrize("how", ["zlab", "model_prefix", "default_layer_ids"])
def test_published_dflash_matches_reference(how, deep_target, tmp_path):
    default = how == "default_layer_ids"  # DFlash's default: one target layer per drafter layer, [1, 5] of 8
    kw = dict(n_ctx=2, dflash_config={"mask_token_id": MASK_ID}) if default else {}
    path, sd = dflash_dir(tmp_path / "h", how, **kw)
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    head = load_head(path, target=deep_target)
    ids = [1, 5] if default else [1, 3, 5]
    c = head.config
    assert (c.kind, c.block_size, c.draft_layers) == ("dflash", DFLASH_BLOCK - 1, 2)
    assert c.feature_layers == [i + 1 for i in ids]  # treedec's convention: the inputs of the next layers
    prompt, _ = inputs(21)
    root = torch.tensor(7)
    got = dflash_marginals(head, deep_target, prompt, root, DFLASH_BLOCK - 1)
    want = ref_dflash(sd, deep_target, prompt, root, ids, MASK_ID, DFLASH_BLOCK)
    assert got.shape == want.shape == (1, DFLASH_BLOCK - 1, V)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the reference tells the conventions apart: layer outputs (not inputs), the mask token's row, the root's row
    assert (ref_dflash(sd, deep_target, prompt, root, [i - 1 for i in ids], MASK_ID, DFLASH_BLOCK) - want).abs().max() > 1e-3
    assert (ref_dflash(sd, deep_target, prompt, root, ids, MASK_ID + 1, DFLASH_BLOCK) - want).abs().max() > 1e-3
    assert (ref_dflash(sd, deep_target, prompt, torch.tensor(8), ids, MASK_ID, DFLASH_BLOCK) - want).abs().max() > 1e-3


@pytest.mark.parametrize("case,expect", [
    ("speculators", "a speculators DFlash drafter (speculators_model_type 'dflash'); treedec reads z-lab's DFlash "
                    "layout (DFlashDraftModel, a dflash_config key): convert it to that layout"),
    ("tensors", "the tensors are a DFlash drafter's (hidden_norm.weight, no lm_head.weight), but the config is not "
                "(no DFlashDraftModel architecture, no dflash_config): use the config.json published with these weights"),
    ("no_block", "a DFlash drafter's config names its block_size (e.g. 16); none found"),
    ("sliding", "this DFlash drafter has sliding-window layers (use_sliding_window / layer_types); treedec's DFlash "
                "layers attend to the whole context, so it cannot serve them"),
    ("no_mask_id", "a DFlash drafter's dflash_config names its mask_token_id; none found"),
    ("mask_outside", f"dflash_config.mask_token_id {V} is outside the vocabulary of {V} tokens"),
    ("layer_ids_deep", "dflash_config.target_layer_ids [1, 3, 8] reach past the target's 8 layers (ids 0..7): the "
                       "drafter was trained for a deeper model"),
    ("fc_disagrees", f"dflash_config.target_layer_ids names 2 layers, so fc.weight should be {(H, 2 * H)}, but it is "
                     f"{(H, 3 * H)}: the config and the weights disagree"),
    ("layers_disagree", "num_hidden_layers is 3, but the weights hold layers [0, 1]: the config and the weights disagree"),
])
def test_dflash_refusals_name_what_differs(case, expect, deep_target, tmp_path):
    how = case if case in ("speculators", "tensors") else "zlab"
    change = {"sliding": dict(use_sliding_window=True, sliding_window=4),
              "no_mask_id": dict(dflash_config={"target_layer_ids": [1, 3, 5]}),
              "mask_outside": dict(dflash_config={"mask_token_id": V, "target_layer_ids": [1, 3, 5]}),
              "layer_ids_deep": dict(dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [1, 3, 8]}),
              "fc_disagrees": dict(dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [1, 3]}),
              "layers_disagree": dict(num_hidden_layers=3), "no_block": dict(block_size=None)}.get(case, {})
    path, _ = dflash_dir(tmp_path / "h", how, **change)
    msg = _one_line_error(path, deep_target)
    assert expect in msg and str(path) in msg


def test_dflash_missing_tensor_and_no_target_are_one_line_errors(deep_target, tmp_path):
    path, sd = dflash_dir(tmp_path / "h")
    assert "load it with its target" in _one_line_error(path)
    _resave(path, {k: v for k, v in sd.items() if k != "layers.1.mlp.up_proj.weight"})
    assert "missing tensors ['layers.1.mlp.up_proj.weight']" in _one_line_error(path, deep_target)
    _resave(path, {**sd, "layers.0.self_attn.extra.weight": torch.zeros(1)})
    assert "unexpected tensors ['layers.0.self_attn.extra.weight']" in _one_line_error(path, deep_target)


@pytest.mark.parametrize("case", ["no_mask_key", "eagle3_with_mask_hidden", "no_block_size", "no_embed_no_target",
                                  "mask_id_outside", "mask_ids_disagree"])
def test_peagle_refusals_name_what_is_missing(case, deep_target, tmp_path):
    cfg = {"no_mask_key": dict(ptd_token_id=None, architectures=["PEagleDraftModel"]),
           "eagle3_with_mask_hidden": dict(ptd_token_id=None),  # an EAGLE-3 config: the mask_hidden tensor tells
           "no_block_size": dict(num_speculative_tokens=None), "mask_id_outside": dict(ptd_token_id=V),
           "mask_ids_disagree": dict(pard_token=MASK_ID + 1)}.get(case, {})
    path, _ = peagle_dir(tmp_path / "h", deep_target, own_embed=case != "no_embed_no_target", **cfg)
    cj = path / "config.json"
    want = {
        "no_mask_key": f"{cj}: a P-EAGLE head's mask positions read the embedding of its mask token, and the config "
                       "names none (mask_token_id, pard_token, ptd_token_id); add the id it was trained with",
        "no_block_size": f"{cj}: a P-EAGLE head drafts K positions per pass and the config names no K "
                         "(num_speculative_tokens, speculators_config.proposal_methods[].speculative_tokens, num_depths "
                         "or para_depths); add \"num_speculative_tokens\": K, at most the depths it was trained for",
        "no_embed_no_target": f"{path}: a P-EAGLE head without embed_tokens.weight reads its mask token's ({MASK_ID}) "
                              "embedding from the target's table: load it with its target (load_head(path, "
                              "target=model))",
        "mask_id_outside": f"{cj}: ptd_token_id={V} is outside the vocabulary (0..{V - 1})",
        "mask_ids_disagree": f"{cj}: the mask token ids disagree ({{'pard_token': {MASK_ID + 1}, 'ptd_token_id': "
                             f"{MASK_ID}}}); keep the one it was trained with",
    }
    want["eagle3_with_mask_hidden"] = want["no_mask_key"]
    assert _one_line_error(path, None if case == "no_embed_no_target" else deep_target) == want[case]


def _edit_layer_cfg(path, **change):  # the layer's fields: transformer_layer_config in a speculators config
    cfg = json.loads((path / "config.json").read_text())
    layer = cfg.get("transformer_layer_config", cfg)
    layer.update(change)
    (path / "config.json").write_text(json.dumps(cfg))


# A published P-EAGLE config.json that contradicts its weights: the field, what it says, what the weights say.
FIELD_VS_WEIGHTS = [  # (dialect, the layer config's change, the error after "<config.json>: ")
    ("vllm", dict(num_hidden_layers="1"),
     "\"num_hidden_layers\" is '1', not an integer, and the weights hold 1 layer: write it as the JSON integer 1"),
    ("speculators", dict(num_hidden_layers="1"),
     "\"transformer_layer_config.num_hidden_layers\" is '1', not an integer, and the weights hold 1 layer: write it "
     "as the JSON integer 1"),
    ("vllm", dict(num_hidden_layers=1.0), "\"num_hidden_layers\" is 1.0, not an integer, and the weights hold 1 layer: "
                                          "write it as a JSON integer"),
    ("vllm", dict(hidden_size=2 * H), f"hidden_size is {2 * H}, but the weights say {H} (fc.weight has shape "
                                      f"({H}, {3 * H}))"),
    ("speculators", dict(hidden_size=2 * H), f"transformer_layer_config.hidden_size is {2 * H}, but the weights say "
                                             f"{H} (fc.weight has shape ({H}, {3 * H}))"),
    ("vllm", dict(vocab_size=V + 1), f"vocab_size is {V + 1}, but the weights say {V} (embed_tokens.weight has shape "
                                     f"({V}, {H}))"),
    ("vllm", dict(intermediate_size=FF + 1), f"intermediate_size is {FF + 1}, but the weights say {FF} "
                                            f"(midlayer.mlp.gate_proj.weight has shape ({FF}, {H}))"),
    ("vllm", dict(num_key_value_heads=NH), f"num_key_value_heads x head_dim ({NH} x {HD}) is {NH * HD}, but the weights "
                                           f"say {NKV * HD} (midlayer.self_attn.k_proj.weight has shape "
                                           f"({NKV * HD}, {2 * H}))"),
    ("vllm", dict(draft_vocab_size=39), "draft_vocab_size is 39, but the weights say 40 (lm_head.weight has shape "
                                        f"(40, {H}))"),
]


@pytest.mark.parametrize("dialect, change, says", FIELD_VS_WEIGHTS)
def test_peagle_config_fields_are_checked_against_the_weights(dialect, change, says, deep_target, tmp_path):
    path, _ = peagle_dir(tmp_path / "h", deep_target, dialect=dialect)
    (_edit_cfg if "draft_vocab_size" in change else _edit_layer_cfg)(path, **change)
    assert _one_line_error(path, deep_target) == (
        f"{path / 'config.json'}: {says}" + ("" if "num_hidden_layers" in change else
                                            ": the config and the weights disagree; correct config.json (or use the "
                                            "config.json published with these weights)"))
