"""EAGLE-3 head: an independent reference forward, fusion, save/load, and the training-time test
agreeing with what the drafter computes at decode time."""
import math

import pytest
import torch
import torch.nn.functional as F

from treedec.decoding.drafter import Drafter
from treedec.heads import DraftConfig, build_head, load_head
from treedec.heads.eagle3 import Eagle3Head, ttt_mask
from treedec.models import LlamaConfig, Transformer

H, NH, NKV, HD = 32, 4, 2, 8


def pair(seed=0, layers=6, k=20, vocab=50):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=H, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=NH, num_key_value_heads=NKV, max_position_embeddings=128)
    target = Transformer(cfg, "sdpa").eval()
    head = build_head(DraftConfig.for_target(cfg, kind="eagle3", draft_vocab_size=k, rope_theta=5000.0))
    with torch.no_grad():  # norms away from 1, so a wrong norm shows
        for n, p in head.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    if k:
        head.restrict_vocab(torch.randperm(vocab)[:k])
    return target, head.eval().bind(target)


def reference(sd: dict, embed: torch.Tensor, tokens, feats, theta: float, eps=1e-6):
    """Plain torch from the state dict: fc, norms, 2H attention with RoPE and a causal mask, MLP, norm, lm_head."""
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    T = tokens.shape[1]
    h = feats @ sd["fc.weight"].T
    x = torch.cat((rms(embed[tokens], sd["layer.input_layernorm.weight"]), rms(h, sd["layer.hidden_norm.weight"])), -1)
    q = (x @ sd["layer.self_attn.q_proj.weight"].T).view(1, T, NH, HD).transpose(1, 2)
    k = (x @ sd["layer.self_attn.k_proj.weight"].T).view(1, T, NKV, HD).transpose(1, 2)
    v = (x @ sd["layer.self_attn.v_proj.weight"].T).view(1, T, NKV, HD).transpose(1, 2)
    inv = 1.0 / theta ** (torch.arange(0, HD, 2).float() / HD)
    ang = torch.arange(T).float()[:, None] * inv[None]
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    rot = lambda t: t * cos + torch.cat((-t[..., HD // 2:], t[..., : HD // 2]), -1) * sin
    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(NH // NKV, 1), v.repeat_interleave(NH // NKV, 1)
    att = (q @ k.transpose(-1, -2) / math.sqrt(HD)).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -1e30)
    a = (att.softmax(-1) @ v).transpose(1, 2).reshape(1, T, NH * HD)
    h = h + a @ sd["layer.self_attn.o_proj.weight"].T
    m = rms(h, sd["layer.post_attention_layernorm.weight"])
    g, u = m @ sd["layer.mlp.gate_proj.weight"].T, m @ sd["layer.mlp.up_proj.weight"].T
    h = h + (F.silu(g) * u) @ sd["layer.mlp.down_proj.weight"].T
    return h, rms(h, sd["norm.weight"]) @ sd["lm_head.weight"].T


def run(head, tokens, feats):
    cache = head.new_cache(1, 32)
    h = head(tokens, head.project(feats), cache, torch.arange(tokens.shape[1])[None])
    return h, head.logits(h)


@pytest.mark.parametrize("fused", [False, True])
def test_forward_equals_an_independent_reference(fused):
    target, head = pair()
    sd = {k: v.clone() for k, v in head.state_dict().items()}
    assert sd["fc.weight"].shape == (H, 3 * H) and "fc.bias" not in sd and "embed_tokens.weight" not in sd
    assert sd["layer.self_attn.q_proj.weight"].shape == (NH * HD, 2 * H) and sd["lm_head.weight"].shape == (20, H)
    assert head.config.feature_layers == [2, 3, 3]
    if fused:
        head.layer.fuse()
        assert set(head.state_dict()) == set(sd)  # file names unchanged
    tokens, feats = torch.randint(0, 50, (1, 9)), torch.randn(1, 9, 3 * H)
    h, logits = run(head, tokens, feats)
    ref_h, ref_logits = reference(sd, target.model.embed_tokens.weight, tokens, feats, theta=5000.0)
    torch.testing.assert_close(h, ref_h, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    # the training path (step 0) is the same function
    torch.testing.assert_close(head.forward_train(tokens, feats)[0], ref_logits, atol=1e-5, rtol=1e-5)


def test_features_are_the_target_layer_inputs_in_order():
    target, head = pair(layers=6)
    head.config.feature_layers = [4, 1, 2]
    ids = torch.randint(0, 50, (2, 7))
    out = target(ids, target.new_cache(2, 8), layer_inputs=head.feature_layers_needed)
    full = target.forward_train(ids, layer_inputs=(1, 2, 4))  # the cache-free pass returns the same inputs
    want = torch.cat([full.layer_inputs[i] for i in (4, 1, 2)], -1)
    assert head.features(out).shape == (2, 7, 3 * H)
    torch.testing.assert_close(head.features(out), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want[..., :H], want[..., H:2 * H])  # distinct layers, really


def test_save_load_round_trip_keeps_vocab_and_outputs(tmp_path):
    target, head = pair(seed=1)
    head.save(tmp_path)
    loaded = load_head(tmp_path, target=target)
    assert isinstance(loaded, Eagle3Head) and loaded.layer.self_attn.fused
    assert torch.equal(loaded.vocab_ids, head.vocab_ids)
    tokens, feats = torch.randint(0, 50, (1, 6)), torch.randn(1, 6, 3 * H)
    torch.testing.assert_close(run(loaded, tokens, feats)[1], run(head, tokens, feats)[1], atol=1e-5, rtol=1e-5)
    ids = torch.arange(3)
    assert torch.equal(loaded.to_target_ids(ids), head.vocab_ids[ids])


def test_bind_checks_feature_layers_against_the_target():
    target, _ = pair(layers=6)
    head = build_head(DraftConfig.for_target(target.config, kind="eagle3", feature_layers=[2, 3, 6]))
    with pytest.raises(ValueError, match=r"layers \[2, 3, 6\].*6 layers.*0\.\.5"):
        head.bind(target)
    with pytest.raises(ValueError, match="unknown draft kind 'eagle4'"):
        build_head(DraftConfig.for_target(target.config, kind="eagle4"))
    with pytest.raises(ValueError, match="LM head's 20 rows; got 5"):
        pair()[1].restrict_vocab(torch.arange(5))


def test_ttt_mask_is_the_drafters_visibility():
    m = ttt_mask(5, 2)  # step 2, query t: prefix s <= t-2, step-1 key t-1, its own key t
    assert m.shape == (5, 15)
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert m[0].nonzero().flatten().tolist() == [10]  # no parent: itself only (never trained)


@pytest.mark.parametrize("seed", range(2))
def test_training_time_test_equals_drafting_the_true_continuation(seed):
    """Step i of the unrolled training pass at position n-1+i is the drafter's depth-i node that follows
    the true tokens: same logits. So the head trains on exactly what it computes when drafting."""
    target, head = pair(seed=seed, k=0)
    S, steps = 14, 3
    ids = torch.randint(0, 50, (1, S))
    feats = head.features(target.forward_train(ids, layer_inputs=head.feature_layers_needed))
    with torch.no_grad():
        train = head.forward_train(ids[:, 1:], feats[:, :-1], steps=steps)
    for n in (4, 7):  # the verified prefix x_0..x_n (n entries in the draft cache); root token x_n
        d = Drafter(head, 1, 32)
        d.catch_up(ids[:, 1:n + 1], feats[:, :n], torch.tensor([n]), [n], ids[:, n])
        torch.testing.assert_close(d.root_logits[0], train[0][0, n - 1], atol=1e-5, rtol=1e-5)
        parent, n_prev = d.root_feat[:, None], 0
        for depth in range(1, steps):
            anc = torch.ones(1, n_prev + 1, dtype=torch.bool)  # a chain: every earlier tree node is an ancestor
            feat, logits = d.expand(ids[:, n + depth: n + depth + 1], parent, depth, anc, n_prev)
            torch.testing.assert_close(logits[0, 0], train[depth][0, n - 1 + depth], atol=1e-5, rtol=1e-5)
            parent, n_prev = feat, n_prev + 1
