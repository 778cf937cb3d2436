"""The jsonl corpus: chat masks cover assistant turns only, the cache is reused, errors name the line;
DraftModule's masked loss ignores every masked position; draft training runs on chat data."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY_ARCH, compose_config
from tests.training.jobs import conversation, write_jsonl
from treedec.data.chat import ChatRenderer, spans_to_mask
from treedec.data.corpus import parse_record
from treedec.data.datamodules import JsonlDataModule
from treedec.data.token_cache import tokenize_jsonl
from treedec.models.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", ["fallback", CHATML])
def test_chat_mask_covers_assistant_turns_only(tokenizer, template):
    tok = Tokenizer(tokenizer[1])
    msgs = parse_record(conversation(7), "t")[1]
    text, spans = ChatRenderer(tok, template)(msgs)
    enc = tok.tk.encode(text, add_special_tokens=False)
    mask = spans_to_mask(enc.offsets, spans)
    ids = torch.tensor(enc.ids)
    kept = tok.decode(ids[torch.from_numpy(mask)].tolist(), skip_special_tokens=False)
    dropped = tok.decode(ids[~torch.from_numpy(mask)].tolist(), skip_special_tokens=False)
    assert "def reply_7(x):\n    return x + 7\n" in kept and "return 7" in kept
    assert not any(w in kept for w in ("QUERY7", "please", "again", "Code only", "User", "system"))
    assert "QUERY7 please" in dropped and "reply_7" not in dropped
    # each span is one assistant reply (plus the end-of-turn text of the format)
    replies = [m["content"] for m in msgs if m["role"] == "assistant"]
    assert len(spans) == 2 and all(text[s:e].startswith(r) for (s, e), r in zip(spans, replies))


def test_chat_batches_and_cache(chat_file, tokenizer, tmp_path):
    tok = Tokenizer(tokenizer[1])
    dm = JsonlDataModule(str(chat_file), str(tokenizer[0]), seq_len=64, batch_size=4, val_fraction=0.25,
                         cache_dir=str(tmp_path))
    dm.prepare_data()
    dm.setup("fit")
    assert dm.is_chat and dm.meta["chat_template"] == "fallback"
    b = next(iter(dm.train_dataloader()))
    assert set(b) == {"input_ids", "loss_mask", "attention_mask"} and b["input_ids"].shape == (4, 65)
    assert b["loss_mask"].dtype == torch.bool and not (b["loss_mask"] & ~b["attention_mask"]).any()
    for row in range(4):
        kept = tok.decode(b["input_ids"][row][b["loss_mask"][row]].tolist())
        assert "def reply_" in kept and "QUERY" not in kept
    assert torch.equal(next(iter(dm.train_dataloader()))["input_ids"], b["input_ids"])  # seeded
    val = next(iter(dm.val_dataloader()))
    assert val["input_ids"].shape[1] == 65
    prompts = dm.eval_prompts(2, 16)
    assert prompts and all(0 < len(p) <= 16 for p in prompts)
    assert tok.decode(prompts[0]).endswith("Assistant:\n")  # the history up to the generation prompt
    # a second tokenisation (next epoch, resumed job) reuses the memory-mapped cache
    mtime = (dm.token_dir / "train.tokens.bin").stat().st_mtime_ns
    again = tokenize_jsonl(str(tokenizer[0]), chat_file, val_fraction=0.25, cache_dir=tmp_path)
    assert again == dm.token_dir and (again / "train.tokens.bin").stat().st_mtime_ns == mtime


def test_text_lines_give_windows(tokenizer, tmp_path):
    rows = [{"text": f"def f{i}(a):\n    return a * {i}\n"} for i in range(60)]
    dm = JsonlDataModule(str(write_jsonl(tmp_path / "t.jsonl", rows)), str(tokenizer[0]), seq_len=16, batch_size=4,
                         val_fraction=0.2, cache_dir=str(tmp_path))
    dm.setup("fit")
    b = next(iter(dm.train_dataloader()))
    assert isinstance(b, torch.Tensor) and b.shape == (4, 17) and b.dtype == torch.long
    assert dm.meta["format"] == "text" and dm.eval_prompts(2, 8)


def test_clear_errors(tokenizer, tmp_path):
    tp = str(tokenizer[0])

    def load(rows):
        dm = JsonlDataModule(str(write_jsonl(tmp_path / "bad.jsonl", rows)), tp, cache_dir=str(tmp_path))
        dm.prepare_data()

    with pytest.raises(FileNotFoundError, match="does not exist"):
        JsonlDataModule(str(tmp_path / "missing.jsonl"), tp, cache_dir=str(tmp_path)).prepare_data()
    with pytest.raises(ValueError, match=r"bad.jsonl:3: not valid JSON"):
        load([{"text": "a"}, "", '{"text": "b"'])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: turn 1 has unknown role 'tool'"):
        load([conversation(0), {"conversations": [{"from": "human", "value": "x"}, {"from": "tool", "value": "y"}]}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a text line in a chat corpus"):
        load([conversation(0), {"text": "x"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a line needs a 'text' string or a 'conversations' list"):
        load([{"prompt": "x"}])


def test_masked_loss_ignores_masked_positions(target_dir):
    from treedec.training.draft import DraftModule

    torch.manual_seed(0)
    m = DraftModule(str(target_dir), target_dtype="float32", feature_noise=0.0)
    ids = torch.randint(1, TINY_ARCH["vocab_size"], (2, 24))
    full = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        plain = m.losses(ids, 0.0)
        for k, v in m.losses({"input_ids": ids, "loss_mask": full}, 0.0).items():  # all-ones mask == plain tensor
            torch.testing.assert_close(v, plain[k])
        mask = torch.zeros_like(full)
        mask[:, 5:14] = True  # an "assistant turn" in the middle
        ref = m.losses({"input_ids": ids, "loss_mask": mask}, 0.0)
        # different tokens after the turn: every kept position sees the same context and targets
        other = ids.clone()
        other[:, 15:] = torch.randint(1, TINY_ARCH["vocab_size"], (2, 9))
        got = m.losses((other, mask), 0.0)
        for k in ref:
            torch.testing.assert_close(got[k], ref[k])
        assert not torch.allclose(m.losses(other, 0.0)["loss"], plain["loss"])  # ...which the unmasked loss sees
        # different CE targets / next-feature targets at masked positions: same loss
        real = m.target_features
        kept = mask[:, 1:].clone()

        def perturbed(x):
            feats, logits = real(x)
            noise = torch.zeros_like(logits)
            noise[:, 1:][~kept] = 5 * torch.randn_like(noise[:, 1:][~kept])
            tail = torch.zeros_like(feats)
            tail[:, 15:] = torch.randn_like(tail[:, 15:])  # masked targets that feed no kept position
            return feats + tail, logits + noise

        m.target_features = perturbed
        for k, v in m.losses({"input_ids": ids, "loss_mask": mask}, 0.0).items():
            torch.testing.assert_close(v, ref[k])
        m.target_features = real
        # right padding is folded into the mask; left padding is refused
        att = torch.ones_like(full)
        att[:, 20:] = False
        padded = m.losses({"input_ids": ids, "loss_mask": full, "attention_mask": att}, 0.0)
        cut = m.losses({"input_ids": ids, "loss_mask": torch.arange(24).expand(2, 24) < 20}, 0.0)
        torch.testing.assert_close(padded["loss"], cut["loss"])
        with pytest.raises(ValueError, match="pad on the right"):
            m.losses({"input_ids": ids, "loss_mask": full, "attention_mask": ~att}, 0.0)


def test_train_on_chat_jsonl(target_dir, chat_file, tmp_path):
    from treedec.train import run

    ovr = [f"model.path={target_dir}", "model.dtype=float32", "export_dir=null", f"paths.run_dir={tmp_path / 'run'}",
           "data=jsonl", f"data.path={chat_file}", "data.seq_len=60", "data.batch_size=4", "data.val_fraction=0.25",
           f"data.cache_dir={tmp_path / 'cache'}", "data.max_val_windows=4", "trainer.max_steps=4",
           "trainer.max_time=null", "trainer.val_check_interval=4", "trainer.precision=32-true",
           "optim.time_budget_s=null", "optim.warmup_steps=1", "eval.n_prompts=2", "eval.prompt_tokens=16",
           "eval.max_new_tokens=4", "eval.every_n_steps=0", "ckpt_every_n_steps=2", "log_every=2", "num_threads=1"]
    m = run(compose_config("train", ovr))
    assert m["steps"] == 4 and 1.0 <= m["tau"] < 1.5 and 0.0 <= m["val"]["val/top1_acc"] <= 1.0  # 4 steps: untrained


def test_pretrain_on_text_jsonl_trains_its_tokenizer(tmp_path):
    from treedec.pretrain import run

    rows = [{"text": f"def f{i}(a, b):\n    return a * {i} + b\n"} for i in range(80)]
    path = write_jsonl(tmp_path / "code.jsonl", rows)
    arch = [f"model_arch.{k}={v}" for k, v in TINY_ARCH.items()] + ["model_arch.head_dim=8"]
    ovr = arch + ["data=jsonl", f"data.path={path}", "data.seq_len=32", "data.batch_size=4", "data.val_fraction=0.2",
                  f"data.cache_dir={tmp_path / 'cache'}", f"paths.run_dir={tmp_path / 'run'}", "export_dir=null",
                  "trainer.max_steps=3", "trainer.max_time=null", "trainer.precision=32-true", "num_threads=1",
                  "optim.time_budget_s=null", "optim.warmup_steps=1", "ckpt_every_n_steps=3", "log_every=1"]
    m = run(compose_config("pretrain", ovr))
    assert m["steps"] == 3 and m["val_loss"] is not None and (tmp_path / "run" / "tokenizer.json").is_file()
