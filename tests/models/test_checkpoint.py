"""Checkpoint I/O: clear errors for bad directories and weights, safetensors only, the tokenizer wrapper."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import treedec.models.checkpoint as ckpt
from tests.helpers import full_logits, tiny_model
from treedec.models import SUPPORTED_ARCHITECTURES, load_model
from treedec.models.checkpoint import CheckpointError, save_pretrained
from treedec.models.tokenizer import load_tokenizer, save_tokenizer


@pytest.fixture
def saved(tmp_path) -> Path:
    save_pretrained(tiny_model(seed=0), tmp_path / "m")
    return tmp_path / "m"


def test_roundtrip(saved):
    model = load_model(saved)
    ref = tiny_model(seed=0)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(full_logits(model, ids), full_logits(ref, ids), atol=0, rtol=0)
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training


def test_tied_embeddings_saved_once(tmp_path):
    model = tiny_model(seed=1, tie_word_embeddings=True)
    save_pretrained(model, tmp_path)
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    loaded = load_model(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_dtype_options(saved, tmp_path):
    assert load_model(saved, dtype="bf16").dtype == torch.bfloat16
    assert load_model(saved, dtype=torch.float32).dtype == torch.float32
    save_pretrained(load_model(saved), tmp_path / "b", dtype="bf16")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_model(tmp_path / "b", dtype="auto").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(saved, dtype="int3")


def test_unsupported_architecture(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        load_model(saved)
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in str(e.value)
    assert "GPT2LMHeadModel" in str(e.value)


@pytest.mark.parametrize("key,value,needle", [
    ("hidden_size", "256", '"hidden_size" must be an integer, got \'256\' (write 256 without quotes)'),
    ("architectures", "LlamaForCausalLM", '"architectures" must be a list of names like ["LlamaForCausalLM"]'),
    ("tie_word_embeddings", "false", '"tie_word_embeddings" must be true/false'),
    ("eos_token_id", [2, "3"], '"eos_token_id" must be an integer or a list of integers or null'),
    ("num_hidden_layers", 0, '"num_hidden_layers" must be >= 1'),
    ("rope_theta", None, '"rope_theta" must be a number'),
])
def test_config_field_types_are_checked(saved, key, value, needle):
    """A mistyped config.json field is a CheckpointError naming the file and the field, not a TypeError later."""
    cfg = json.loads((saved / "config.json").read_text())
    cfg[key] = value
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_model(saved)
    assert str(e.value).startswith(str(saved / "config.json")) and needle in str(e.value)


def test_config_with_valid_optional_fields_loads(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg.update(eos_token_id=[1, 2], bos_token_id=None, rope_scaling=None, head_dim=cfg.get("head_dim"), rms_norm_eps=1)
    (saved / "config.json").write_text(json.dumps(cfg))
    assert load_model(saved).config.eos_ids == [1, 2]


def test_resolve_device(saved):
    assert ckpt.resolve_device("auto") == ckpt.resolve_device(None) == torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    assert ckpt.resolve_device("CPU") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu0'; use auto, cpu, cuda or cuda:N"):
        ckpt.resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA, which is not available here"):
            ckpt.resolve_device("cuda")
        with pytest.raises(ValueError, match="needs CUDA"):
            load_model(saved, device="cuda:0")
        assert load_model(saved, device="auto").device == torch.device("cpu")
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            ckpt.resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model directory"):
        load_model(tmp_path / "nope")


def test_missing_config(saved):
    (saved / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(saved)


def test_invalid_config_json(saved):
    (saved / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(saved)


def test_missing_weights_file(saved):
    (saved / "model.safetensors").unlink()
    (saved / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(FileNotFoundError, match="model.safetensors") as e:
        load_model(saved)
    assert "pickle" in str(e.value)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "truncate-data"])
def test_truncated_or_corrupt_weights(saved, damage):
    f = saved / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "truncate-data":
        f.write_bytes(data[:-100])
    else:
        f.write_bytes(b"\x13\x37" * 100)
    with pytest.raises(CheckpointError) as e:
        load_model(saved)
    assert str(f) in str(e.value) and "corrupt" in str(e.value)


def test_wrong_tensor_shape(saved):
    f = saved / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_model(saved)
    msg = str(e.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "(100, 64)" in msg and "(112, 64)" in msg


def test_config_disagrees_with_weights(saved):
    cfg = json.loads((saved / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (saved / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"expects \(128, 64\)"):
        load_model(saved)


def test_missing_tensor(saved):
    f = saved / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.0.self_attn.k_proj.weight"]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.layers.0.self_attn.k_proj.weight"):
        load_model(saved)


def test_unexpected_tensor(saved):
    f = saved / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        load_model(saved)


def test_rotary_buffers_ignored(saved):
    f = saved / "model.safetensors"
    sd = load_file(str(f))
    for i in range(2):
        sd[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(sd, str(f), metadata={"format": "pt"})
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    torch.testing.assert_close(full_logits(load_model(saved), ids), full_logits(tiny_model(seed=0), ids))


def test_missing_shard(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path, max_shard_size="40KB")
    sorted(tmp_path.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_model(tmp_path)


def test_bundled_model_missing_names_pretrain(tmp_path, monkeypatch):
    monkeypatch.setitem(ckpt.BUNDLED, "tiny-code", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="python -m treedec.pretrain"):
        load_model("tiny-code")
    with pytest.raises(FileNotFoundError, match="python -m treedec.pretrain"):
        load_tokenizer("tiny-code")


def test_no_pickle(saved, monkeypatch):
    import pickle

    def refuse(*a, **k):
        raise AssertionError("pickle/torch.load must never be used to read checkpoints")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    load_model(saved)
    for mod in ("checkpoint.py", "tokenizer.py"):
        src = (Path(ckpt.__file__).parent / mod).read_text()
        assert "torch.load(" not in src and "import pickle" not in src


# --------------------------------------------------------------------------- tokenizer
def make_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "<|im_end|>": 3}
    for w in "hello world how are you system user assistant : \n".split(" "):
        vocab.setdefault(w, len(vocab))
    tk = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    from tokenizers import AddedToken

    tk.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True),
                           AddedToken("<|im_end|>", special=True)])
    return tk


TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}assistant : {% endif %}")


@pytest.fixture
def tok_dir(tmp_path) -> Path:
    d = tmp_path / "tok"
    d.mkdir()
    make_tokenizer().save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "special": True, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False}, "add_bos_token": True,
        "chat_template": TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast"}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    return d


def test_tokenizer_basics(tok_dir):
    tok = load_tokenizer(tok_dir)
    ids = tok.encode("hello world")
    assert ids[0] == tok.bos_id == 0
    assert tok.encode("hello world", add_bos=False) == ids[1:]
    assert tok.decode(ids) == "hello world"
    assert set(tok.eos_ids) == {1, 3}
    assert tok.vocab_size == len(make_tokenizer().get_vocab())


def test_chat_template_matches_transformers(tok_dir):
    msgs = [{"role": "system", "content": "hello"}, {"role": "user", "content": "how are you"}]
    tok = load_tokenizer(tok_dir)
    text = tok.apply_chat_template(msgs)
    assert text.startswith("<s>system : hello <|im_end|> ") and text.endswith("assistant : ")
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert text == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(text, add_bos=False, specials=True)  # its markup
    assert tok.apply_chat_template(msgs, tokenize=True)[0] == 0  # one BOS, from the template only


def test_no_chat_template_is_clear(tmp_path):
    d = tmp_path / "t"
    save_tokenizer(make_tokenizer(), d)
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(d).apply_chat_template([{"role": "user", "content": "hello"}])


def test_missing_tokenizer_json(saved):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(saved)


def test_save_pretrained_with_tokenizer(tmp_path, tok_dir):
    model = tiny_model(seed=0, eos_token_id=1, bos_token_id=0)
    save_pretrained(model, tmp_path / "m", tokenizer=load_tokenizer(tok_dir))
    tok = load_tokenizer(tmp_path / "m")
    assert tok.encode("how are you") == load_tokenizer(tok_dir).encode("how are you")
    assert 1 in tok.eos_ids and tok.chat_template == TEMPLATE
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    assert hf.encode("how are you", add_special_tokens=False) == tok.encode("how are you", add_bos=False)
    # a raw tokenizers.Tokenizer works too
    save_pretrained(model, tmp_path / "raw", tokenizer=make_tokenizer())
    assert load_tokenizer(tmp_path / "raw").eos_ids == [1]


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "lm_head.weight"])
def test_non_finite_target_weights_are_refused(saved, name):
    sd = load_file(str(saved / "model.safetensors"))
    sd[name][7, 3] = float("inf") if name == "lm_head.weight" else float("nan")
    save_file(sd, str(saved / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"m/model.safetensors: tensor '{name}' holds NaN or Inf"):
        load_model(saved)


def test_config_json_must_be_an_object(saved):
    (saved / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"config.json holds a JSON list, not a JSON object"):
        load_model(saved)
