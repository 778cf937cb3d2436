"""Logits parity with Hugging Face ``transformers`` on small random checkpoints of every supported family."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from tests.helpers import full_logits, randomize_, tiny_model
from treedec.models import load_model
from treedec.models.checkpoint import save_pretrained

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
              rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

CASES = {
    "llama-gqa": ("LlamaConfig", dict(num_key_value_heads=2, max_position_embeddings=512)),
    "llama-mha": ("LlamaConfig", dict(num_key_value_heads=4, max_position_embeddings=512)),
    # theta 5e5, head_dim 16: wavelengths span ~6 to ~6e5, so the llama3 rule scales some, smooths some
    # (2048..8192) and keeps the rest; positions near 20000 make the difference visible.
    "llama3-rope": ("LlamaConfig", dict(num_key_value_heads=2, max_position_embeddings=131072, rope_theta=500000.0,
                                        rope_scaling=LLAMA3_ROPE)),
    "llama-attn-bias": ("LlamaConfig", dict(num_key_value_heads=2, attention_bias=True, max_position_embeddings=512)),
    "llama-tied": ("LlamaConfig", dict(num_key_value_heads=1, tie_word_embeddings=True, max_position_embeddings=512)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, max_position_embeddings=4096, sliding_window=4096)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, max_position_embeddings=512, rope_theta=1e6)),
    "qwen2-tied": ("Qwen2Config", dict(num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)),
    # head_dim 24 != hidden/heads (16): Qwen3 sizes heads on their own; q_norm/k_norm per head before RoPE
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=24, max_position_embeddings=512, rope_theta=1e6)),
    "qwen3-tied-bias": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                                            tie_word_embeddings=True, attention_bias=True)),
}


def hf_model(case: str, seed: int = 0):
    cls, kw = CASES[case]
    cfg = getattr(transformers, cls)(**COMMON, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize_(model, seed)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.float().eval()


@torch.inference_mode()
def hf_logits(model, ids: torch.Tensor, position_offset: int = 0) -> torch.Tensor:
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1) + position_offset
    return model(input_ids=ids, position_ids=pos).logits


def ids_for(seed: int, B: int = 2, T: int = 13, V: int = 97) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_hf_checkpoint_logits_match(case, tmp_path):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, attn_backend="eager")
    offset = 20000 if case == "llama3-rope" else 0
    ids = ids_for(1)
    want = hf_logits(hf, ids, offset)
    got = full_logits(ours, ids, offset)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    sdpa = load_model(tmp_path, attn_backend="sdpa")
    torch.testing.assert_close(full_logits(sdpa, ids, offset), want, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_matters(tmp_path):
    """Over a long sequence (relative distances ~ the scaled wavelengths) the llama3 rule is what
    makes treedec agree with transformers: the same weights without the scaling disagree."""
    hf = hf_model("llama3-rope")
    hf.save_pretrained(tmp_path / "scaled")
    ids = torch.randint(0, 97, (1, 1500), generator=torch.Generator().manual_seed(2))
    want = hf_logits(hf, ids)
    torch.testing.assert_close(full_logits(load_model(tmp_path / "scaled"), ids), want, atol=1e-4, rtol=1e-4)
    hf.save_pretrained(tmp_path / "plain")
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        cfg.pop(key, None)
    cfg["rope_theta"] = 500000.0
    (tmp_path / "plain" / "config.json").write_text(json.dumps(cfg))
    unscaled = load_model(tmp_path / "plain")
    assert unscaled.config.rope_scaling is None
    assert (full_logits(unscaled, ids) - want).abs().max() > 1e-2


def test_config_fields_mapped(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path / "q")
    hf_model("llama3-rope").save_pretrained(tmp_path / "l")
    hf_model("mistral").save_pretrained(tmp_path / "m")
    hf_model("qwen3").save_pretrained(tmp_path / "w")
    q, ll, m, w = (load_model(tmp_path / n).config for n in "qlmw")
    assert q.architecture == "Qwen2ForCausalLM" and q.qkv_bias and not q.o_bias and q.rope_theta == 1e6
    assert not q.qk_norm and not ll.qk_norm
    assert w.architecture == "Qwen3ForCausalLM" and w.qk_norm and w.head_dim == 24 and not w.qkv_bias
    assert ll.rope_theta == 500000.0 and ll.rope_scaling["rope_type"] == "llama3" and ll.rope_scaling["factor"] == 8.0
    assert m.architecture == "MistralForCausalLM" and m.context_length == 4096


@pytest.mark.parametrize("case", ["llama-gqa", "llama-tied", "qwen2", "llama3-rope", "llama-attn-bias", "mistral", "qwen3",
                                  "qwen3-tied-bias"])
def test_treedec_checkpoint_loads_in_transformers(case, tmp_path):
    """treedec random model -> treedec save_pretrained -> transformers from_pretrained: same logits."""
    cls, kw = CASES[case]
    src = tmp_path / "hf"
    hf_model(case).save_pretrained(src)  # only to get a treedec config for this family
    ours = load_model(src, attn_backend="eager")
    randomize_(ours, seed=7)
    if ours.config.tie_word_embeddings:
        ours.lm_head.weight = ours.model.embed_tokens.weight
    out = tmp_path / "treedec"
    save_pretrained(ours, out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    assert type(hf).__name__ == ours.config.architecture
    offset = 20000 if case == "llama3-rope" else 0
    ids = ids_for(3)
    torch.testing.assert_close(hf_logits(hf, ids, offset), full_logits(ours, ids, offset), atol=1e-4, rtol=1e-4)
    # and back into treedec
    again = load_model(out, attn_backend="eager")
    torch.testing.assert_close(full_logits(again, ids, offset), full_logits(ours, ids, offset), atol=0, rtol=0)


def test_treedec_native_model_roundtrip(tmp_path):
    """A Transformer built from a LlamaConfig directly (no HF source) saves in a form transformers loads."""
    ours = tiny_model(seed=5, tie_word_embeddings=True)
    save_pretrained(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    ids = ids_for(4)
    torch.testing.assert_close(hf_logits(hf, ids), full_logits(ours, ids), atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("llama-gqa")
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = load_model(tmp_path)
    ids = ids_for(5)
    torch.testing.assert_close(full_logits(ours, ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_bf16_load(tmp_path):
    hf = hf_model("qwen2")
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    ids = ids_for(6)
    got = full_logits(ours, ids).float()
    want = hf_logits(hf, ids)
    assert (got - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("case", ["qwen2"])
def test_bf16_greedy_matches_transformers_generate(case, tmp_path):
    """RoPE is applied in the model dtype as transformers does, so bf16 greedy decoding agrees token for token."""
    from treedec.decoding.vanilla import generate

    hf_model(case, seed=1).save_pretrained(tmp_path)
    ours = load_model(tmp_path, dtype="bf16")
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    except TypeError:
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None  # Llama's default EOS (2) would stop it or, with min_new_tokens, be masked
    prompt = ids_for(8, B=1, T=9)
    with torch.inference_mode():
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=40,
                           do_sample=False, pad_token_id=0)[0, 9:].tolist()
    assert len(want) == 40
    assert generate(ours, prompt, 40, eos_ids=[]).tokens[0] == want


def test_qwen3_norms_matter_and_survive_fusion(tmp_path):
    """The q/k norms are real weights: unit norms change the logits; fused and unfused loads agree."""
    hf_model("qwen3").save_pretrained(tmp_path)
    ids = ids_for(9)
    fused, plain = load_model(tmp_path), load_model(tmp_path, fuse=False)
    assert fused.model.layers[0].self_attn.fused and not plain.model.layers[0].self_attn.fused
    torch.testing.assert_close(full_logits(fused, ids), full_logits(plain, ids), atol=1e-5, rtol=1e-5)
    assert set(fused.state_dict()) == set(plain.state_dict())  # HF names either way
    with torch.no_grad():
        for layer in plain.model.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
    assert (full_logits(plain, ids) - full_logits(fused, ids)).abs().max() > 1e-3


@pytest.mark.parametrize("seed", range(3))
def test_qwen3_speculative_greedy_equals_vanilla(seed, tmp_path):
    """Tree-masked verification with q/k norms: greedy fp32 speculative decoding is vanilla token for token."""
    from treedec.decoding.speculative import SpeculativeDecoder
    from treedec.decoding.vanilla import generate
    from treedec.heads import DraftConfig, build_head
    from treedec.tree.policies import DynamicPolicy, StaticPolicy

    hf_model("qwen3", seed=seed).save_pretrained(tmp_path)
    target = load_model(tmp_path, attn_backend="sdpa")
    torch.manual_seed(seed)
    draft = randomize_(build_head(DraftConfig.for_target(target.config)), seed).eval().bind(target)
    prompt = ids_for(seed, B=1, T=7 + 5 * seed)[0].tolist()
    want = generate(target, [prompt], 48, eos_ids=[]).tokens[0]
    for policy in (DynamicPolicy(total_tokens=20, depth=5, top_k=4), StaticPolicy(shape="balanced_2x3")):
        assert SpeculativeDecoder(target, draft, policy, eos_ids=[]).generate(prompt, 48).tokens[0] == want
