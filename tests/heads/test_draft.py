"""EAGLE draft head: shapes, shared target weights, safetensors round trip and clear errors."""
import copy
import json
import warnings

import pytest
import torch

from treedec.heads import DraftConfig, build_head, load_head, target_fingerprint
from treedec.heads.config import DRAFT_CONFIG, DRAFT_WEIGHTS
from treedec.models import LlamaConfig, Transformer
from treedec.models.packed import PackedLinear


def small_target(vocab=50, hidden=32):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Transformer(cfg, "sdpa").eval()


def test_head_shares_target_embedding_and_lm_head(tmp_path):
    target = small_target()
    head = build_head(DraftConfig.for_target(target.config, target="small")).bind(target)
    names = [n for n, _ in head.named_parameters()]
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert head.fc.in_features == 2 * 32
    cache = head.new_cache(1, 16)
    feat = head(torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 32), cache, torch.arange(3)[None])
    logits = head.logits(feat)
    assert feat.shape == (1, 3, 32) and logits.shape == (1, 3, 50)
    assert torch.allclose(logits, target.lm_head(feat))
    head.save(tmp_path)
    saved = json.loads((tmp_path / DRAFT_CONFIG).read_text())
    assert saved["target"] == "small" and saved["target_fingerprint"] == target_fingerprint(target)
    loaded = load_head(tmp_path, target=target)
    run = lambda h: h.logits(h(torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 32), h.new_cache(1, 16), torch.arange(3)[None]))
    assert torch.allclose(run(loaded), run(head))


def test_head_trained_for_another_target_warns_naming_both(tmp_path):
    torch.manual_seed(0)
    trained_for = small_target()
    build_head(DraftConfig.for_target(trained_for.config, target="small-a")).bind(trained_for).save(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_head(tmp_path, target=trained_for)  # its own target: silent
    other = small_target()  # same shapes, other weights
    with pytest.warns(UserWarning, match=r"small-a.*fingerprint " + target_fingerprint(trained_for)) as rec:
        load_head(tmp_path, target=other)
    assert target_fingerprint(other) in str(rec[0].message)


def test_fingerprint_ignores_dtype_but_not_weights():
    t = small_target()
    fp = target_fingerprint(t)
    assert target_fingerprint(t.to(torch.bfloat16)) == fp
    with torch.no_grad():
        t.lm_head.weight[0] += 1.0
    assert target_fingerprint(t) != fp


@pytest.mark.parametrize("head_dtype,target_dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_a_head_of_another_dtype_than_its_target_drafts(head_dtype, target_dtype):
    target = small_target().to(target_dtype)
    head = build_head(DraftConfig.for_target(target.config)).to(head_dtype).bind(target)
    feats = torch.randn(1, 2, 32, dtype=target_dtype)
    feat = head(torch.tensor([[1, 2]]), feats, head.new_cache(1, 8), torch.arange(2)[None])
    logits = head.logits(feat)  # in the head's dtype: its LM head rows are a copy in that dtype
    assert feat.dtype == head_dtype and logits.dtype == head_dtype
    ref = torch.nn.functional.linear(feat.to(target_dtype), target.lm_head.weight).float()
    assert torch.allclose(logits.float(), ref, atol=0.05, rtol=0.02)


def test_auto_dtype_is_the_faster_of_fp32_and_packed_bf16_on_a_cpu(tmp_path, monkeypatch):
    """``dtype="auto"`` for a bf16 target on a CPU is what this machine runs a head's few-row matmuls faster in
    (measured once per process), fp32 for an fp32 target; a bf16 head is packed, its LM rows too."""
    from treedec.heads import dtype as draft_dtype

    target = small_target().to(torch.bfloat16)
    build_head(DraftConfig.for_target(target.config)).to(torch.bfloat16).bind(target).save(tmp_path)
    assert load_head(tmp_path, target=target).fc.weight.dtype == torch.bfloat16  # None: the file's dtype
    for faster, dtype in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(draft_dtype, "packed_bf16_is_faster", lambda shapes, rows=4, f=faster: f)
        head = load_head(tmp_path, target=target, dtype="auto")
        lm = target.lm_head.weight if head._lm_weight is None else head._lm_weight  # (the target's own, shared)
        assert head.fc.weight.dtype == dtype and lm.dtype == dtype
        assert (head._lm_packed is not None) == (dtype == torch.bfloat16) == isinstance(head.fc, PackedLinear)
    assert load_head(tmp_path, target=target.float(), dtype="auto").fc.weight.dtype == torch.float32
    assert load_head(tmp_path, target=target, dtype="bf16").fc.weight.dtype == torch.bfloat16


def test_a_packed_bf16_head_drafts_what_the_unpacked_one_does():
    """Packing (its layers and its LM rows) changes the kernel's weight layout, not the numbers."""
    target = small_target().to(torch.bfloat16)
    plain = build_head(DraftConfig.for_target(target.config)).to(torch.bfloat16)
    plain.layer.fuse()
    plain.bind(target)
    packed = copy.deepcopy(plain).prepare(target)
    assert isinstance(packed.fc, PackedLinear) and packed._lm_packed is not None and plain._lm_packed is None
    tokens, feats = torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        a = plain(tokens, feats, plain.new_cache(1, 8), torch.arange(3)[None])
        b = packed(tokens, feats, packed.new_cache(1, 8), torch.arange(3)[None])
        assert torch.equal(a, b) and torch.equal(plain.logits(a), packed.logits(b))


def test_feature_layers_must_fit_the_head_kind_and_the_target():
    head = build_head(DraftConfig.for_target(small_target().config, feature_layers=[5]))
    with pytest.raises(ValueError, match=r"EAGLE-1/2 draft head reads the final hidden state.*\[5\].*eagle3"):
        head.bind(small_target())
    head = build_head(DraftConfig.for_target(small_target().config, kind="eagle3", feature_layers=[0, 1, 5]))
    with pytest.raises(ValueError, match=r"target layers \[0, 1, 5\], but the target has 2 layers"):
        head.bind(small_target())


def test_feature_layers_default_per_kind():
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=12,
                      num_attention_heads=4, num_key_value_heads=2)
    assert DraftConfig.for_target(cfg).feature_layers == [-1]
    assert DraftConfig.for_target(cfg, kind="eagle3").feature_layers == [2, 6, 9]
    assert DraftConfig.for_target(cfg, kind="eagle3", feature_layers=None).feature_layers == [2, 6, 9]


def test_mismatched_target_is_a_clear_error():
    head = build_head(DraftConfig.for_target(small_target().config, target="small"))
    with pytest.raises(ValueError, match="does not fit the target"):
        head.bind(small_target(vocab=60))
    with pytest.raises(ValueError, match="hidden"):
        head.bind(small_target(hidden=48))


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="train"):
        load_head(tmp_path / "nowhere")
    head = build_head(DraftConfig.for_target(small_target().config))
    head.save(tmp_path)
    (tmp_path / DRAFT_WEIGHTS).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read draft weights"):
        load_head(tmp_path)
    (tmp_path / DRAFT_CONFIG).write_text("{broken")
    with pytest.raises(ValueError, match="corrupt"):
        load_head(tmp_path)


def test_unbound_head_says_how_to_fix():
    head = build_head(DraftConfig.for_target(small_target().config))
    with pytest.raises(RuntimeError, match="bind"):
        head(torch.tensor([[1]]), torch.zeros(1, 1, 32), head.new_cache(1, 4), torch.zeros(1, 1, dtype=torch.long))


def test_multi_layer_features_are_refused_until_the_decoder_feeds_them():
    head = build_head(DraftConfig.for_target(small_target().config, feature_layers=[0]))
    with pytest.raises(ValueError, match="feature_layers=\\[-1\\]"):
        head.bind(small_target())


def test_rope_frequencies_stay_fp32_in_a_bf16_head():
    head = build_head(DraftConfig.for_target(small_target().config)).to(torch.bfloat16)
    assert head.inv_freq.dtype == torch.float32 and head.fc.weight.dtype == torch.bfloat16
    fresh = build_head(DraftConfig.for_target(small_target().config))
    assert torch.equal(head.inv_freq, fresh.inv_freq)


def test_load_refuses_a_target_given_by_name(tmp_path):
    build_head(DraftConfig.for_target(small_target().config)).save(tmp_path)
    with pytest.raises(TypeError, match=r"a loaded model \(treedec.models.load_model\('tiny-code'\)\), not str"):
        load_head(tmp_path, target="tiny-code")
    with pytest.raises(TypeError, match="not str"):
        load_head("tiny-code-eagle", target="tiny-code")  # a bundled head, read before binding


def test_non_finite_head_weights_are_refused(tmp_path):
    from treedec.models.checkpoint import CheckpointError

    head = build_head(DraftConfig.for_target(small_target().config))
    with torch.no_grad():
        head.layer.mlp.down_proj.weight[1, 2] = float("-inf")
    head.save(tmp_path)
    with pytest.raises(CheckpointError, match=rf"{DRAFT_WEIGHTS}: tensor 'layer.mlp.down_proj.weight' holds NaN or Inf"):
        load_head(tmp_path)
