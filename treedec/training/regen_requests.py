"""What ``python -m treedec.regenerate`` reads and decodes: the input's records (text or chats; a malformed line is
an error naming it, or skipped with ``on_error=skip``) and the requests made of them, one continuation of a text
record, or each assistant turn of a chat in order (:class:`~treedec.training.predict.Prompt`'s protocol)."""
from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass

from treedec.data.corpus import read_jsonl
from treedec.training.predict import Prompt

log = logging.getLogger("treedec.regenerate")  # the command's own name, as in its other messages


@dataclass
class Record:
    index: int  # position among the kept records (decides the shard)
    line: int
    obj: dict
    kind: str  # text | chat
    payload: object  # the text, or [{"role", "content"}, ...]

    @property
    def id(self):
        return self.obj.get("id", self.line)


def read_records(path: str, fmt: str = "auto", on_error: str = "fail") -> tuple[list[Record], list[dict]]:
    """The input's records and the malformed lines skipped (``[{"line", "error"}]``; only with on_error=skip)."""
    errors: list = [] if on_error == "skip" else None
    records, kind = [], None if fmt == "auto" else fmt
    try:
        for line, raw, k, payload in read_jsonl(path, errors):
            where = f"{path}:{line}"
            problem = None
            if k != (kind := kind or k):
                problem = f"{where}: a {k} line in a {kind} file; one file holds one kind (text or chat)"
            elif k == "text" and not payload.strip():
                problem = f"{where}: the text is empty: there is no prompt to continue"
            elif k == "chat" and not any(m["role"] == "assistant" for m in payload):
                problem = f"{where}: the conversation has no assistant turn to regenerate"
            if problem is None:
                records.append(Record(len(records), line, json.loads(raw), k, payload))
            elif errors is None:
                raise ValueError(problem)
            else:
                errors.append((line, problem))
    except ValueError as exc:
        raise ValueError(f"{exc}. Fix the line, or pass on_error=skip to skip malformed lines") from None
    skipped = [{"line": n, "error": msg} for n, msg in sorted(errors or [])]
    for s in skipped:
        log.warning("skipping line %d: %s", s["line"], s["error"])
    return records, skipped


class TextRequest(Prompt):
    """A text record: its first ``prompt_tokens`` tokens (whole characters), continued once; its random stream
    is keyed by its line number (ids repeat, or are null)."""

    def __init__(self, rec: Record, tok, prompt_tokens: int):
        super().__init__(rec.line, tok.encode_head(rec.payload, prompt_tokens))
        self.rec, self.tok = rec, tok

    def output(self) -> dict:
        text = self.tok.decode(self.ids + _continuation(self.tokens, self.tok))
        return {**self.rec.obj, "id": self.rec.id, "text": text}


class ChatRequest:
    """A chat record: each assistant turn in order, the earlier ones already the target's."""

    def __init__(self, rec: Record, tok, renderer):
        self.rec, self.tok, self.renderer, self.key = rec, tok, renderer, rec.line  # (the random stream's key)
        self.messages = [dict(m) for m in rec.payload]
        self.todo = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]

    def next_prompt(self) -> list[int] | None:
        if not self.todo:
            return None
        return self.tok.encode(self.renderer.render(self.messages[:self.todo[0]], add_generation_prompt=True),
                               add_bos=False, specials=True)  # the template's special tokens

    def take(self, tokens: list[int]) -> None:
        self.messages[self.todo.pop(0)]["content"] = self.tok.decode(_continuation(tokens, self.tok))

    def output(self) -> dict:
        obj = copy.deepcopy(self.rec.obj)
        turns = obj["conversations"] if "conversations" in obj else obj["messages"]
        for turn, m in zip(turns, self.messages):  # the record's own keys (value / content) keep their names
            turn["value" if "value" in turn else "content"] = m["content"]
        return {**obj, "id": self.rec.id}


def _continuation(tokens: list[int], tok) -> list[int]:
    """The target's tokens without their EOS, and without a character the budget cut short (no U+FFFD)."""
    return tok.whole_chars(tokens[:-1] if tokens and tokens[-1] in set(tok.eos_ids) else tokens)
