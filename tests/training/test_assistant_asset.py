"""The bundled assistant `tiny-code-assistant` (a small draft LM for transformers' assisted generation):
the bundled target's tokenizer, vocabulary and context, in Hugging Face layout, bf16."""
from __future__ import annotations

import json

import torch

from treedec.models.paths import ASSETS


def test_assistant_shares_the_targets_tokenizer_and_context():
    from safetensors import safe_open

    from treedec.models import load_model
    from treedec.models.tokenizer import load_tokenizer

    path, target = ASSETS / "tiny-code-assistant", ASSETS / "tiny-code"
    assert {p.name for p in path.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                                "tokenizer.json", "tokenizer_config.json"}
    a, t = json.loads((path / "config.json").read_text()), json.loads((target / "config.json").read_text())
    assert a["num_hidden_layers"] == 2 and a["torch_dtype"] == "bfloat16"
    for key in ("vocab_size", "hidden_size", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert a[key] == t[key], key
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    ta, tt = load_tokenizer(path), load_tokenizer(target)
    assert ta.tk.get_vocab() == tt.tk.get_vocab()
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n"
    assert ta.encode(text) == tt.encode(text)
    # trained: on held-out stdlib files it predicts far better than chance (ln 8192 = 9.0 nats)
    from treedec.data.corpus import read_source, split_files, stdlib_root

    model = load_model(path, dtype=torch.float32)
    losses = []
    for name in split_files(None, "validation")[:3]:
        ids = torch.tensor([tt.encode(read_source(stdlib_root(), name))[:256]])
        with torch.no_grad():
            logits = model.forward_train(ids)
        losses.append(float(torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])))
    assert sum(losses) / len(losses) < 4.5, losses
