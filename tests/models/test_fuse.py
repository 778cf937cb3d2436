"""Fused q/k/v and gate/up projections: same function, same Hugging Face state-dict names."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import full_logits, tiny_config, tiny_model
from treedec.heads import DraftConfig, build_head, load_head
from treedec.models import load_model
from treedec.models.checkpoint import save_pretrained

HF_NAMES = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight"}


@pytest.mark.parametrize("bias", [False, True])
def test_fused_model_is_the_same_function(bias):
    model = tiny_model(seed=3, fuse=False, qkv_bias=bias, mlp_bias=bias)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(3))
    want, want_train = full_logits(model, ids), model.forward_train(ids).detach()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert model.fuse() is model and model.model.layers[0].self_attn.fused and model.model.layers[1].mlp.fused
    attn = model.model.layers[0].self_attn
    assert not hasattr(attn, "q_proj") and attn.qkv_proj.weight.shape == (4 * 16 + 2 * 2 * 16, 64)
    assert (attn.qkv_proj.bias is not None) == bias
    torch.testing.assert_close(full_logits(model, ids), want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(model.forward_train(ids).detach(), want_train, atol=2e-6, rtol=1e-5)
    after = model.state_dict()  # HF names, the same tensors, storage not shared
    assert list(sorted(after)) == list(sorted(before))
    assert all(torch.equal(after[k], before[k]) for k in before)
    q, k = after["model.layers.0.self_attn.q_proj.weight"], after["model.layers.0.self_attn.k_proj.weight"]
    assert q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()
    model.fuse()  # idempotent
    torch.testing.assert_close(full_logits(model, ids), want, atol=2e-6, rtol=1e-5)


def test_fused_module_loads_hf_names_and_trains():
    src = tiny_model(seed=1, fuse=False, qkv_bias=True)
    dst = tiny_model(seed=2, qkv_bias=True)
    assert not dst.load_state_dict(src.state_dict()).missing_keys
    ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(full_logits(dst, ids), full_logits(src, ids), atol=2e-6, rtol=1e-5)
    with pytest.raises(RuntimeError, match="q_proj.weight"):  # a missing HF tensor is still an error
        bad = {k: v for k, v in src.state_dict().items() if k != "model.layers.1.self_attn.k_proj.weight"}
        dst.load_state_dict(bad)
    dst.train()
    dst.forward_train(ids).float().pow(2).mean().backward()  # the fused weights are ordinary parameters
    assert dst.model.layers[0].self_attn.qkv_proj.weight.grad is not None


def test_load_model_fuses_by_default(tmp_path):
    model = tiny_model(seed=4, fuse=False)
    save_pretrained(model, tmp_path)
    fused, plain = load_model(tmp_path), load_model(tmp_path, fuse=False)
    assert fused.model.layers[0].mlp.fused and not plain.model.layers[0].mlp.fused
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(full_logits(fused, ids), full_logits(plain, ids), atol=2e-6, rtol=1e-5)
    save_pretrained(fused, tmp_path / "again")  # saved from the fused model, in HF layout
    from safetensors.torch import load_file

    names = set(load_file(str(tmp_path / "again" / "model.safetensors")))
    assert {f"model.layers.1.{n}" for n in HF_NAMES} <= names and not any("qkv" in n or "gate_up" in n for n in names)
    torch.testing.assert_close(full_logits(load_model(tmp_path / "again"), ids), full_logits(fused, ids), atol=0, rtol=0)


def test_draft_head_with_fused_layer_keeps_its_file_format(tmp_path):
    cfg = DraftConfig.for_target(tiny_config())
    head = build_head(cfg)
    torch.nn.init.normal_(head.layer.self_attn.q_proj.weight)
    want = {k: v.clone() for k, v in head.state_dict().items()}
    head.layer.fuse()
    head.save(tmp_path)
    loaded = load_head(tmp_path)  # strict=False load into an unfused head: nothing missing or unexpected
    assert all(torch.equal(loaded.state_dict()[k], want[k]) for k in want)
    again = build_head(cfg)
    again.layer.fuse()
    missing, unexpected = again.load_state_dict(want, strict=False)
    assert not missing and not unexpected
    assert all(torch.equal(again.state_dict()[k], want[k]) for k in want)
