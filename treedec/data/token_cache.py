"""Corpora tokenised once into flat memory-mapped files, keyed by everything that changes the tokens.

* :func:`tokenize_corpus`: the stdlib corpus, ``<cache_dir>/tokens/<tokenizer>-<corpus>/{train,validation}.bin``,
  each ``EOS f1 EOS f2 ... EOS`` (every file starts right after an EOS);
* :func:`tokenize_jsonl`: a JSON-lines corpus, ``<cache_dir>/jsonl/<settings>-<file>/<split>.tokens.bin``
  (documents back to back), ``<split>.mask.bin`` (chat: 1 per assistant token) and
  ``<split>.offsets.npy`` (document starts).

Both write through one :class:`TokenWriter` (every file via :func:`treedec.atomic.atomic_file`) and
write ``meta.json`` last: its presence marks a complete cache, so an interrupted build is redone and
later epochs, resumed jobs and other runs never re-tokenise.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from treedec.atomic import atomic_file
from treedec.data.chat import ChatRenderer, spans_to_mask
from treedec.data.corpus import (
    corpus_fingerprint,
    jsonl_files,
    line_split,
    read_jsonl,
    read_source,
    split_files,
    stdlib_root,
)
from treedec.data.files import file_fingerprint
from treedec.data.tokenizer_train import EOS, as_tokenizer, tokenizer_hash

DEFAULT_CACHE = Path(os.environ.get("TREEDEC_CACHE", Path.home() / ".cache" / "treedec"))
SPLITS = ("train", "validation")
JSONL_VERSION = "jsonl-v2"  # bump when the rendering, masking or cache layout changes (v2: specials in text are text)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


class TokenWriter(contextlib.AbstractContextManager):
    """One split's documents appended to ``tokens`` (and a uint8 ``mask`` per token, and the int64 document
    ``offsets``, when given); the files appear, renamed into place, only when the block succeeds."""

    def __init__(self, tokens: Path, dtype: np.dtype, mask: Path | None = None, offsets: Path | None = None):
        self.paths, self.dtype = (tokens, mask, offsets), np.dtype(dtype)
        self.offsets, self.n_masked, self.n_unmasked_docs = [0], 0, 0

    def __enter__(self) -> "TokenWriter":
        self._stack = contextlib.ExitStack()
        self._files = [None if p is None else self._stack.enter_context(open(
            self._stack.enter_context(atomic_file(p)), "wb")) for p in self.paths[:2]]
        return self

    @property
    def n_tokens(self) -> int:
        return self.offsets[-1]

    def add(self, ids: Sequence[int], mask: np.ndarray | None = None) -> None:
        np.asarray(ids, dtype=self.dtype).tofile(self._files[0])
        if self._files[1] is not None:
            mask = np.asarray(mask, dtype=bool)
            mask.astype(np.uint8).tofile(self._files[1])
            self.n_masked += int(mask.sum())
            self.n_unmasked_docs += int(not mask.any())
        self.offsets.append(self.offsets[-1] + len(ids))

    def __exit__(self, *exc) -> bool:
        if exc[0] is None and self.paths[2] is not None:
            with atomic_file(self.paths[2]) as tmp, open(tmp, "wb") as f:
                np.save(f, np.asarray(self.offsets, dtype=np.int64))
        return bool(self._stack.__exit__(*exc))


def _write_meta(d: Path, meta: dict) -> Path:
    with atomic_file(d / "meta.json") as tmp:  # last: its presence marks a complete cache
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
    return d


def tokenize_corpus(tok, root: str | os.PathLike | None = None, val_fraction: float = 0.03,
                    cache_dir: str | os.PathLike | None = None) -> Path:
    """Tokenise both splits of the stdlib corpus once (``tok``: a ``tokenizers.Tokenizer``); returns the directory."""
    root = Path(root) if root else stdlib_root()
    cache_dir = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    d = cache_dir / "tokens" / f"{tokenizer_hash(tok)[:16]}-{corpus_fingerprint(root, val_fraction)[:16]}"
    if (d / "meta.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    eos = tok.token_to_id(EOS)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = token_dtype(vocab)
    meta = {"root": str(root), "val_fraction": val_fraction, "dtype": dtype.name, "eos_id": eos,
            "vocab_size": vocab, "splits": {}}
    for split in SPLITS:
        files = split_files(root, split, val_fraction)
        with TokenWriter(d / f"{split}.bin", dtype) as w:
            for i in range(0, len(files), 64):
                encs = tok.encode_batch([read_source(root, f) for f in files[i:i + 64]], add_special_tokens=False)
                for e in encs:
                    w.add([eos] + e.ids)
            w.add([eos])
        meta["splits"][split] = {"files": len(files), "tokens": w.n_tokens}
    return _write_meta(d, meta)


def open_tokens(token_dir: str | os.PathLike, split: str) -> np.memmap:
    meta = json.loads((Path(token_dir) / "meta.json").read_text())
    return np.memmap(Path(token_dir) / f"{split}.bin", dtype=np.dtype(meta["dtype"]), mode="r")


def _encode_texts(tok, texts: list[str]) -> list[list[int]]:
    """``tok.encode(text)`` for each text (BOS as the checkpoint adds it; a special token's string in a text is
    text), batched, plus an EOS at the end unless the encoding already starts with EOS (then EOS separates
    documents, as in the stdlib stream)."""
    eos = tok.eos_ids[0] if tok.eos_ids else tok.token_to_id(EOS)
    return [ids if eos is None or (ids and ids[0] == eos) else ids + [eos] for ids in tok.encode_batch(texts)]


def tokenize_jsonl(tokenizer, path: str | os.PathLike, val_path: str | os.PathLike | None = None,
                   val_fraction: float = 0.02, format: str = "auto", chat_template: str | None = "auto",
                   cache_dir: str | os.PathLike | None = None, chunk: int = 512) -> Path:
    """Tokenise a JSONL corpus once into ``<cache_dir>/jsonl/<settings>-<file>/``; reuse it afterwards.

    The key covers the tokenizer, the chat rendering, the split settings and the SHA-1 of the file(s).
    Without ``val_path`` a line is validation when the SHA-1 of its bytes falls below ``val_fraction``
    (deterministic, and duplicate lines share a split).
    """
    tok = as_tokenizer(tokenizer)
    renderer = ChatRenderer(tok, chat_template)
    if format not in ("auto", "text", "chat"):
        raise ValueError(f"format must be auto, text or chat, not {format!r}")
    path = Path(path)
    sources = [(f, None) for f in jsonl_files(path)] + ([(Path(val_path), "validation")] if val_path else [])
    for src, _ in sources:
        if not src.is_file():
            raise FileNotFoundError(f"jsonl corpus {src} does not exist (data.path / data.val_path)")
    settings = hashlib.sha1("\0".join([JSONL_VERSION, tokenizer_hash(tok.tk), renderer.fingerprint, format,
                                       repr(float(val_fraction)), str(bool(val_path))]).encode()).hexdigest()
    files = hashlib.sha1("\0".join(file_fingerprint(src) for src, _ in sources).encode()).hexdigest()
    d = (Path(cache_dir) if cache_dir else DEFAULT_CACHE) / "jsonl" / f"{settings[:16]}-{files[:16]}"
    if (d / "meta.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    kind, decided_by = (None if format == "auto" else format), None
    writers: dict[str, TokenWriter] = {}

    def flush(batch: list) -> None:
        if kind == "text":
            encs, masks = _encode_texts(tok, [payload for _, _, payload in batch]), [None] * len(batch)
        else:
            rendered = [renderer(payload, where) for where, _, payload in batch]
            raw = tok.encodings([t for t, _ in rendered], specials=True)  # the template's special tokens
            encs = [e.ids for e in raw]
            masks = [spans_to_mask(e.offsets, spans) for e, (_, spans) in zip(raw, rendered)]
        for (_, sp, _), ids, m in zip(batch, encs, masks):
            writers[sp].add(ids, m)
        batch.clear()

    try:
        with contextlib.ExitStack() as stack:
            batch: list = []
            for src, forced in sources:
                for lineno, raw, line_kind, payload in read_jsonl(src):
                    where = f"{src}:{lineno}"
                    if kind is None:
                        kind, decided_by = line_kind, where
                    if line_kind != kind:
                        first = f" (decided by {decided_by})" if decided_by else f" (data.format={format})"
                        raise ValueError(f"{where}: a {line_kind} line in a {kind} corpus{first}; one file holds one "
                                         f"kind: plain text ('text') or chat ('conversations')")
                    if not writers:
                        writers = {sp: stack.enter_context(TokenWriter(
                            d / f"{sp}.tokens.bin", dtype, d / f"{sp}.mask.bin" if kind == "chat" else None,
                            d / f"{sp}.offsets.npy")) for sp in SPLITS}
                    batch.append((where, forced or ("train" if val_path else line_split(raw, val_fraction)), payload))
                    if len(batch) >= chunk:
                        flush(batch)
            if kind is None or not writers:
                raise ValueError(f"{path} holds no records (every line is blank)")
            flush(batch)
    except BaseException:
        with contextlib.suppress(OSError):
            d.rmdir()  # only if nothing else (another process's build) is in it
        raise
    stats = {sp: {"files": len(w.offsets) - 1, "docs": len(w.offsets) - 1, "tokens": w.n_tokens,
                  "assistant_tokens": w.n_masked, "no_assistant": w.n_unmasked_docs} for sp, w in writers.items()}
    eos = tok.eos_ids[0] if tok.eos_ids else tok.token_to_id(EOS)
    return _write_meta(d, {"version": JSONL_VERSION, "format": kind, "source": str(path),
                           "val_source": str(val_path) if val_path else None, "val_fraction": val_fraction,
                           "dtype": dtype.name, "vocab_size": tok.vocab_size, "eos_id": eos,
                           "bos_id": tok.bos_id, "pad_id": tok.pad_id,
                           "chat_template": renderer.source if kind == "chat" else None, "splits": stats})


__all__ = ["DEFAULT_CACHE", "JSONL_VERSION", "TokenWriter", "open_tokens", "token_dtype", "tokenize_corpus",
           "tokenize_jsonl"]
