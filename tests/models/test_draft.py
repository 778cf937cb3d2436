"""EAGLE draft head: shapes, shared target weights, safetensors round trip and clear errors."""
import json

import pytest
import torch

from treedec.models import LlamaConfig, Transformer
from treedec.models.draft import DRAFT_CONFIG, DRAFT_WEIGHTS, DraftConfig, DraftHead


def small_target(vocab=50, hidden=32):
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Transformer(cfg, "sdpa").eval()


def test_head_shares_target_embedding_and_lm_head(tmp_path):
    target = small_target()
    head = DraftHead(DraftConfig.for_target(target.config, target="small")).bind(target)
    names = [n for n, _ in head.named_parameters()]
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert head.fc.in_features == 2 * 32
    cache = head.new_cache(1, 16)
    feat, logits = head(torch.tensor([[1, 2, 3]]), torch.randn(1, 3, 32), cache, torch.arange(3)[None])
    assert feat.shape == (1, 3, 32) and logits.shape == (1, 3, 50)
    assert torch.allclose(logits, target.lm_head(feat))
    head.save(tmp_path)
    saved = json.loads((tmp_path / DRAFT_CONFIG).read_text())
    assert saved["target"] == "small"
    loaded = DraftHead.load(tmp_path, target=target)
    _, logits2 = loaded(torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 32), head.new_cache(1, 16), torch.arange(3)[None])
    _, logits3 = head(torch.tensor([[1, 2, 3]]), torch.zeros(1, 3, 32), head.new_cache(1, 16), torch.arange(3)[None])
    assert torch.allclose(logits2, logits3)


def test_mismatched_target_is_a_clear_error():
    head = DraftHead(DraftConfig.for_target(small_target().config, target="small"))
    with pytest.raises(ValueError, match="does not fit the target"):
        head.bind(small_target(vocab=60))
    with pytest.raises(ValueError, match="hidden"):
        head.bind(small_target(hidden=48))


def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="train"):
        DraftHead.load(tmp_path / "nowhere")
    head = DraftHead(DraftConfig.for_target(small_target().config))
    head.save(tmp_path)
    (tmp_path / DRAFT_WEIGHTS).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read draft weights"):
        DraftHead.load(tmp_path)
    (tmp_path / DRAFT_CONFIG).write_text("{broken")
    with pytest.raises(ValueError, match="corrupt"):
        DraftHead.load(tmp_path)


def test_unbound_head_says_how_to_fix():
    head = DraftHead(DraftConfig.for_target(small_target().config))
    with pytest.raises(RuntimeError, match="bind"):
        head(torch.tensor([[1]]), torch.zeros(1, 1, 32), head.new_cache(1, 4), torch.zeros(1, 1, dtype=torch.long))
