"""The tokenizer wrapper, the one place text becomes ids: a special token's string in text is text (a chat
template's are tokens); a prompt's head is whole characters and costs a bounded prefix of a long text."""
from __future__ import annotations

import time

import pytest

from treedec.models.tokenizer import Tokenizer, load_tokenizer

SPECIAL = 'SEP = "<|endoftext|>"\nx = 1\n'
TEXTS = ["def add(a, b):\n    return a + b\n" * 40, "# 注释：世界你好。\nprint('你好，世界')\n" * 30,
         "s = '😀 emoji 😀😀 ok'  # ünïcödé\n" * 30, "x" * 3000, "中文" * 700 + " tail", "  \n\n\t  \n" * 100]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    base = load_tokenizer("tiny-code")
    return Tokenizer(base.tk, {**base.tokenizer_config, "eos_token": "<|endoftext|>"}, base.eos_ids,
                     chat_template="{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}")


def test_special_token_strings_in_text_are_text_and_a_chat_template_keeps_its_specials(tok):
    eos = tok.token_to_id("<|endoftext|>")
    ids = tok.encode(SPECIAL)
    assert eos not in ids[1:] and tok.decode(ids) == SPECIAL  # (ids[0]: the BOS the checkpoint adds)
    assert tok.encode_batch([SPECIAL, "y"])[0] == ids
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)
    assert chat[-1] == eos  # the template's <|endoftext|> is the token
    assert tok.encode(SPECIAL, add_bos=False, specials=True).count(eos) == 1  # asked for: parsed


def test_the_jsonl_cache_encodes_special_token_strings_in_text_as_text(tok):
    from treedec.data.token_cache import _encode_texts

    eos = tok.token_to_id("<|endoftext|>")
    (ids,) = _encode_texts(tok, [SPECIAL])
    assert ids.count(eos) == 1 and tok.decode(ids) == SPECIAL  # the document's own separator only


@pytest.mark.parametrize("text", TEXTS)
def test_a_prompt_head_is_whole_characters_and_the_whole_text_tokens(tok, text):
    full = tok.encode(text)
    for n in (1, 2, 3, 4, 5, 7, 16, 64):
        head = tok.encode_head(text, n)
        assert head == tok.whole_chars(full[:n], text)  # the same tokens as tokenizing all of it
        assert n - 3 <= len(head) <= n and "\ufffd" not in tok.decode(head) and text.startswith(tok.decode(head))


def test_whole_chars_drops_a_character_cut_short_but_keeps_a_real_replacement_character(tok):
    ids = tok.encode("ab😀", add_bos=False)
    assert len(ids) >= 3 and tok.decode(ids[:-1]).endswith("\ufffd")  # the emoji is byte tokens
    assert tok.decode(tok.whole_chars(ids[:-1])) == "ab"
    real = "a\ufffd"
    assert tok.decode(tok.whole_chars(tok.encode(real, add_bos=False), real)) == real


def test_a_prompt_head_of_a_multi_megabyte_line_tokenizes_a_prefix_only(tok):
    line = "def f(x):\n    return x + 1\n" * 300_000  # 8 MB: the whole line takes seconds and gigabytes
    t0 = time.perf_counter()
    head = tok.encode_head(line, 64)
    assert time.perf_counter() - t0 < 0.5
    assert head == tok.encode(line[:2000])[:64]
    for word in ("x" * 4_000_000, "中" * 2_000_000):  # one pre-token: cut where it stands once it is that long
        t0 = time.perf_counter()
        assert len(tok.encode_head(word, 16)) >= 13 and time.perf_counter() - t0 < 5


def test_a_lone_surrogate_is_a_one_line_error_not_a_type_error(tok):
    with pytest.raises(ValueError, match=r"'def f\(\): a'\.\.\. holds a lone UTF-16 surrogate \(U\+D800\)"):
        tok.encode("def f(): a\ud800b")
    with pytest.raises(ValueError, match="U\\+DC00"):
        tok.encode_batch(["fine", "x\udc00"])
