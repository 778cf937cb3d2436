"""Chat rendering: a conversation to text, plus the character spans of its assistant turns (the trained part)."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

import numpy as np

from treedec.data.tokenizer_train import EOS, as_tokenizer
from treedec.models.tokenizer import render_chat_template

FALLBACK_HEADERS = {"system": "System:\n", "user": "User:\n", "assistant": "Assistant:\n"}


class ChatRenderer:
    """Conversation -> text, plus the character spans of the assistant turns (the trained part).

    ``chat_template``: ``"auto"``/None uses the tokenizer's template when it has one, else the
    fallback; ``"fallback"`` forces the fallback; a ``*.jinja`` path or an inline jinja string is used
    as the template. With a template, an assistant turn's span is the text that rendering
    ``messages[:i+1]`` adds to ``messages[:i]`` rendered with the generation prompt, so it holds the
    reply and the template's end-of-turn marker (``<|im_end|>``, ``<|eot_id|>``, ...); where a template
    is not prefix-consistent it is the reply's text alone. The fallback format is::

        {bos}System:\n{text}\n\nUser:\n{text}\n\nAssistant:\n{text}{eos}\n\nUser:\n...

    (bos: the token the checkpoint prepends to text, if any; eos: its first EOS, else
    ``<|endoftext|>`` when the vocabulary has it); its assistant spans are ``{text}{eos}`` and its
    generation prompt is ``\n\nAssistant:\n``.
    """

    def __init__(self, tokenizer, chat_template: str | None = "auto"):
        self.tok = as_tokenizer(tokenizer)
        if chat_template in (None, "auto"):
            self.template, self.source = self.tok.chat_template, "tokenizer" if self.tok.chat_template else "fallback"
        elif chat_template == "fallback":
            self.template, self.source = None, "fallback"
        elif "{{" in chat_template or "{%" in chat_template:
            self.template, self.source = chat_template, "custom"
        elif Path(chat_template).is_file():
            self.template, self.source = Path(chat_template).read_text(), "custom"
        else:
            raise FileNotFoundError(f"chat_template {chat_template!r} is neither 'auto', 'fallback', a file nor a "
                                    f"jinja template")
        lead = self.tok.encode("")  # what the checkpoint puts before any text: its BOS, if any
        bos_id = self.tok.bos_id if self.tok.bos_id is not None else (lead[0] if len(lead) == 1 else None)
        self.bos = self._token(bos_id)
        eos_id = self.tok.eos_ids[0] if self.tok.eos_ids else self.tok.token_to_id(EOS)
        self.eos = self._token(eos_id)

    def _token(self, i) -> str:
        return "" if i is None else (self.tok.id_to_token(i) or "")

    @property
    def fingerprint(self) -> str:
        return hashlib.sha1(f"{self.source}\0{self.template or ''}\0{self.bos}\0{self.eos}".encode()).hexdigest()

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation's text; a template that raises is a ValueError (one line: its message and the fix)."""
        if self.template is None:
            return self._fallback(messages, add_generation_prompt)[0]
        try:
            return render_chat_template(self.template, messages, add_generation_prompt=add_generation_prompt,
                                        **self.tok._special_tokens())
        except Exception as exc:  # the template's own raise_exception, a jinja error, a filter's TypeError
            raise template_error(exc, f"the {self.source} chat template",
                                 "set chat_template=fallback (data.chat_template=fallback to train)") from exc

    def _fallback(self, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[int, int]]]:
        parts, spans, pos = [self.bos], [], len(self.bos)
        for i, m in enumerate(messages):
            head = ("\n\n" if i else "") + FALLBACK_HEADERS[m["role"]]
            body = m["content"] + (self.eos if m["role"] == "assistant" else "")
            if m["role"] == "assistant":
                spans.append((pos + len(head), pos + len(head) + len(body)))
            parts += [head, body]
            pos += len(head) + len(body)
        if add_generation_prompt:
            parts.append(("\n\n" if messages else "") + FALLBACK_HEADERS["assistant"])
        return "".join(parts), spans

    def __call__(self, messages: list[dict], where: str = "conversation") -> tuple[str, list[tuple[int, int]]]:
        """``(text, assistant spans)`` of a whole conversation."""
        if self.template is None:
            return self._fallback(messages, False)
        try:
            full = self.render(messages)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from exc
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            span = None
            try:
                pre, upto = self.render(messages[:i], True), self.render(messages[:i + 1])
                if full.startswith(upto) and upto.startswith(pre) and len(pre) >= cursor and len(upto) > len(pre):
                    span = (len(pre), len(upto))
            except Exception:  # some templates refuse partial conversations: locate the reply instead
                pass
            if span is None:
                k = full.find(m["content"], cursor) if m["content"] else -1
                if k < 0:
                    raise ValueError(f"{where}: the chat template does not reproduce assistant turn {i} verbatim, "
                                     f"so its tokens cannot be masked; set data.chat_template=fallback")
                span = (k, k + len(m["content"]))
            spans.append(span)
            cursor = span[1]
        return full, spans


def template_error(exc: Exception, what: str, fix: str) -> ValueError:
    """The one-line error of a chat template that raised while rendering: what raised, its message, the fix."""
    msg = " ".join(str(exc).split()) or type(exc).__name__
    return ValueError(f"{what} failed to render ({type(exc).__name__}: {msg}); fix the template, or {fix}")


def chat_prompt_ids(tok, text: str, fix: str) -> list[int]:
    """The ids of ``text`` as one user turn through ``tok``'s chat template (generate, calibrate, bench with
    ``chat=true``); a template that raises is a ValueError naming ``fix``."""
    try:
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
    except ValueError:
        raise  # no template at all: the tokenizer's own message
    except Exception as exc:
        raise template_error(exc, "the tokenizer's chat template", fix) from exc


def spans_to_mask(offsets, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per-token bool: the token's characters ``[start, end)`` overlap an assistant span."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(off), dtype=bool)
    for s, e in spans:
        mask |= (off[:, 0] < e) & (off[:, 1] > s)
    return mask


__all__ = ["FALLBACK_HEADERS", "ChatRenderer", "chat_prompt_ids", "spans_to_mask", "template_error"]
