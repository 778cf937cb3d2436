"""A small tokenizer wrapper over ``tokenizers`` for Hugging Face model directories.

Reads ``tokenizer.json`` (the fast-tokenizer file every modern HF checkpoint has) and, when
present, ``tokenizer_config.json`` (BOS policy, special tokens, chat template),
``chat_template.jinja``, ``generation_config.json`` and ``config.json`` (EOS ids).
Chat templates are rendered with jinja2 in a sandbox, the way ``transformers`` does, so a
chat model sees exactly the prompt format it was trained on.

jinja2 is imported on the first chat template only: it is no dependency of treedec's (a plain prompt needs none).
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from tokenizers import Tokenizer as HFTokenizer

from treedec.models.paths import resolve_path

TOKENIZER_FILE = "tokenizer.json"
HEAD_CHARS_PER_TOKEN = 8  # encode_head's first prefix: characters per token wanted (grown 4x while short)
HEAD_MAX_WORD = 1 << 16  # encode_head: a word (pre-token) longer than this is cut where it stands


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); restore it from the model's repository") from exc


def _token_str(tok: Any) -> str | None:
    """Special tokens in tokenizer_config.json are strings or AddedToken dicts ({"content": ...})."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return [int(x)] if isinstance(x, int) else [int(i) for i in x]


class Tokenizer:
    """``encode`` / ``decode`` / ``eos_ids`` / ``apply_chat_template`` over a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer, tokenizer_config: dict | None = None, eos_ids: Sequence[int] = (),
                 bos_id: int | None = None, chat_template: str | None = None):
        self.tk = tokenizer
        self.tokenizer_config = dict(tokenizer_config or {})
        cfg = self.tokenizer_config
        eos = list(dict.fromkeys(int(i) for i in eos_ids))
        eos_tok = _token_str(cfg.get("eos_token"))
        if eos_tok is not None and self.tk.token_to_id(eos_tok) is not None:
            tid = self.tk.token_to_id(eos_tok)
            if tid not in eos:
                eos.append(tid)
        self.eos_ids: list[int] = eos
        bos_tok = _token_str(cfg.get("bos_token"))
        if bos_id is None and bos_tok is not None:
            bos_id = self.tk.token_to_id(bos_tok)
        self.bos_id: int | None = bos_id
        pad_tok = _token_str(cfg.get("pad_token"))
        self.pad_id: int | None = self.tk.token_to_id(pad_tok) if pad_tok is not None else None
        tmpl = chat_template if chat_template is not None else cfg.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = tmpl

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, name_or_path: str | os.PathLike) -> "Tokenizer":
        path = resolve_path(name_or_path)
        file = path / TOKENIZER_FILE
        if not file.is_file():
            found = sorted(p.name for p in path.iterdir())
            hint = (" A slow (sentencepiece) tokenizer.model is there: convert it once with transformers: "
                    "`AutoTokenizer.from_pretrained(dir).save_pretrained(dir)` writes tokenizer.json."
                    if "tokenizer.model" in found else "")
            raise FileNotFoundError(
                f"{path} has no {TOKENIZER_FILE} (found: {', '.join(found) or 'nothing'}); treedec reads the "
                f"fast-tokenizer file that Hugging Face checkpoints ship.{hint}"
            )
        try:
            tk = HFTokenizer.from_file(str(file))
        except Exception as exc:
            raise ValueError(f"cannot read {file} ({exc}); it is corrupt or from an incompatible tokenizers version") from exc
        tcfg = _read_json(path / "tokenizer_config.json")
        eos = _as_list(_read_json(path / "config.json").get("eos_token_id"))
        eos += _as_list(_read_json(path / "generation_config.json").get("eos_token_id"))
        tmpl_file = path / "chat_template.jinja"
        tmpl = tmpl_file.read_text() if tmpl_file.is_file() else None
        if tmpl is None and (path / "chat_template.json").is_file():
            tmpl = _read_json(path / "chat_template.json").get("chat_template")
        return cls(tk, tcfg, eos, chat_template=tmpl)

    # ------------------------------------------------------------------ core
    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None, specials: bool = False) -> list[int]:
        """Token ids of ``text``.

        ``add_bos=None`` follows the checkpoint (its post-processor, and tokenizer_config's
        ``add_bos_token``), as ``transformers`` does for ``tokenizer(text)``; True/False force it.
        ``specials=False``: text is text, so a special token's string in it (``"<|endoftext|>"`` in a
        code file) is encoded as the plain characters it is, never as the token (which would end or
        derail the prompt). Text rendered by :meth:`apply_chat_template` holds the template's special
        tokens: encode it with ``add_bos=False, specials=True``.
        """
        return self.encode_batch([text], add_bos, specials)[0]

    def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None, specials: bool = False
                     ) -> list[list[int]]:
        """:meth:`encode` of each text, batched (the one place where treedec turns text into ids)."""
        encs = self.encodings(texts, add_special_tokens=add_bos is None, specials=specials)
        return [self._with_bos([int(i) for i in e.ids], add_bos) for e in encs]

    def encodings(self, texts: Sequence[str], add_special_tokens: bool = False, specials: bool = False) -> list:
        """The ``tokenizers`` encodings (ids, offsets) of ``texts``; ``specials`` as in :meth:`encode`."""
        previous = self.tk.encode_special_tokens
        self.tk.encode_special_tokens = not specials  # True: special-token strings are split as plain text
        try:
            if len(texts) == 1:  # (no thread pool for one text: a later fork would warn about it)
                return [self.tk.encode(texts[0], add_special_tokens=add_special_tokens)]
            return self.tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        except TypeError as exc:  # tokenizers' answer to a str that is not UTF-8: a lone surrogate ("\ud800")
            err = _surrogate_error(texts)
            if err is None:
                raise
            raise err from exc
        finally:
            self.tk.encode_special_tokens = previous

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        """``ids`` with the BOS the checkpoint asks for (``add_bos=None``: ``add_bos_token``), or the caller."""
        if add_bos is None:
            wants = self.tokenizer_config.get("add_bos_token") and self.bos_id is not None
            return [self.bos_id] + ids if wants and (not ids or ids[0] != self.bos_id) else ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but this tokenizer defines no bos_token (tokenizer_config.json)")
            ids = [self.bos_id] + ids
        return ids

    def encode_head(self, text: str, n_tokens: int) -> list[int]:
        """``encode(text)[:n_tokens]`` cut back to whole characters (:meth:`whole_chars`), tokenizing only a
        prefix of ``text``: a prompt of 64 tokens from a 50 MB line costs milliseconds, not a minute and gigabytes.

        The prefix starts at ``HEAD_CHARS_PER_TOKEN`` characters a token and grows 4x while it yields too few
        tokens; it is cut before its last pre-token (the only one that can end differently in the whole text),
        so its tokens are the whole text's. A single word longer than ``HEAD_MAX_WORD`` characters is cut
        where it stands (its last tokens may then differ from the whole text's).
        """
        size = HEAD_CHARS_PER_TOKEN * (n_tokens + 2)
        while size < len(text):
            cut = self._stable_cut(text[:size]) or (size if size >= HEAD_MAX_WORD else 0)
            ids = self.encode(text[:cut]) if cut else []
            if len(ids) > n_tokens + 1:  # (+1: a post-processor may end the prefix with a token of its own)
                return self.whole_chars(ids[:n_tokens], text)
            size *= 4
        return self.whole_chars(self.encode(text)[:n_tokens], text)

    def _stable_cut(self, head: str) -> int:
        """The start of ``head``'s last pre-token; 0 when ``head`` is one word."""
        pre = self.tk.pre_tokenizer
        if pre is None:  # no pre-tokenizer (sentencepiece-style normalizers): words end at spaces
            return max(head.rfind(" "), head.rfind("\n"), 0)
        pieces = pre.pre_tokenize_str(head)
        return pieces[-1][1][0] if len(pieces) > 1 else 0

    def whole_chars(self, ids: Sequence[int], text: str | None = None) -> list[int]:
        """``ids`` without trailing tokens that hold only the first bytes of a character (byte-level tokens cut
        inside a CJK character or an emoji decode to U+FFFD): at most 3, as UTF-8 characters are at most 4
        bytes. With ``text``, the text ``ids`` begin: a U+FFFD that is really there is kept."""
        ids = list(ids)
        for _ in range(3):
            head = self.decode(ids)
            if not head.endswith("\ufffd") or (text is not None and text.startswith(head)):
                break
            ids.pop()
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tk.id_to_token(int(i))

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs) -> str | list[int]:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the checkpoint's chat template.

        Returns the prompt text, or its ids with ``tokenize=True`` (special tokens come from the
        template, so no BOS is added on top). Extra keyword arguments reach the template.
        """
        if not self.chat_template:
            raise ValueError(
                "this tokenizer has no chat template (tokenizer_config.json 'chat_template' or chat_template.jinja); "
                "it is a base model: encode the plain prompt text instead"
            )
        text = render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    **self._special_tokens(), **kwargs)
        return self.encode(text, add_bos=False, specials=True) if tokenize else text

    def _special_tokens(self) -> dict[str, str | None]:
        keys = ("bos_token", "eos_token", "pad_token", "unk_token")
        return {k: _token_str(self.tokenizer_config.get(k)) for k in keys}

    # ------------------------------------------------------------------ saving
    def save(self, path: str | os.PathLike) -> None:
        """Write tokenizer.json and tokenizer_config.json into directory ``path``."""
        save_tokenizer(self, path)


def _surrogate_error(texts: Sequence[str]) -> ValueError | None:
    """The one-line error for the first text holding a lone UTF-16 surrogate (JSON's ``"\\ud800"``), else None."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            return ValueError(f"the text {text[max(0, exc.start - 30):exc.start]!r}... holds a lone UTF-16 surrogate "
                              f"(U+{ord(text[exc.start]):04X}), which is no text; fix the escape in its source")
    return None


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
    """Render a Hugging Face chat template (jinja2, sandboxed, trim/lstrip blocks as in transformers)."""
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - transformers depends on jinja2
        raise ImportError("chat templates need jinja2: `pip install jinja2` (or pass a plain prompt)") from exc

    class _Generation(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant spans; render its body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def save_tokenizer(tokenizer, path: str | os.PathLike, config=None) -> None:
    """Write tokenizer.json (+ tokenizer_config.json) so that both treedec and transformers load it.

    ``tokenizer``: a :class:`Tokenizer`, a ``tokenizers.Tokenizer`` or a path to a tokenizer.json.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = HFTokenizer.from_file(str(tokenizer))
    wrapper = tokenizer if isinstance(tokenizer, Tokenizer) else Tokenizer(tokenizer)
    wrapper.tk.save(str(path / TOKENIZER_FILE))
    tcfg = dict(wrapper.tokenizer_config)
    tcfg.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    if config is not None:
        for key, ids in (("bos_token", [config.bos_token_id] if config.bos_token_id is not None else []),
                         ("eos_token", config.eos_ids)):
            if key not in tcfg and ids and wrapper.id_to_token(ids[0]) is not None:
                tcfg[key] = wrapper.id_to_token(ids[0])
    if wrapper.chat_template and "chat_template" not in tcfg:
        tcfg["chat_template"] = wrapper.chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of ``"tiny-code"`` (the bundled model) or of a local Hugging Face directory."""
    return Tokenizer.from_dir(name_or_path)


__all__ = ["Tokenizer", "load_tokenizer", "render_chat_template", "save_tokenizer"]
