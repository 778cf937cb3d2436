"""The tokenizer side of the data: a byte-level BPE trained on a corpus, and tokenizers loaded for tokenising.

:func:`train_bpe` trains on any texts, :func:`train_tokenizer` on the stdlib corpus's train split;
``<|endoftext|>`` (id 0) is BOS and EOS. :func:`as_tokenizer` turns a path, a ``tokenizers.Tokenizer``
or a treedec :class:`~treedec.models.tokenizer.Tokenizer` into the latter (chat template, BOS/EOS ids).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from treedec.atomic import atomic_file
from treedec.data.corpus import read_source, split_files, stdlib_root
from treedec.models.paths import BUNDLED, resolve_path
from treedec.models.tokenizer import Tokenizer

EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int = 8192, out: str | os.PathLike | None = None,
              length: int | None = None):
    """A byte-level BPE trained on ``texts``; saved atomically to ``out`` if given (a rank may be reading it)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B",
                                                       special_tokens=[(EOS, eos_id)])
    if out is not None:
        with atomic_file(out) as tmp:
            tok.save(str(tmp))
    return tok


def train_tokenizer(root: str | os.PathLike | None = None, vocab_size: int = 8192, val_fraction: float = 0.03,
                    out: str | os.PathLike | None = None):
    """:func:`train_bpe` on the train split of the stdlib corpus (or any ``root`` of ``*.py`` files).

    Encoding with special tokens prepends ``<|endoftext|>``, the context every file starts
    from in training. Returns the ``tokenizers.Tokenizer``.
    """
    root = Path(root) if root else stdlib_root()
    files = split_files(root, "train", val_fraction)
    return train_bpe((read_source(root, f) for f in files), vocab_size, out, length=len(files))


def load_hf_tokenizer(path: str | os.PathLike):
    return tokenizers.Tokenizer.from_file(str(path))


def tokenizer_hash(tok) -> str:
    """SHA-1 of a ``tokenizers.Tokenizer``'s JSON: part of every token cache's key."""
    return hashlib.sha1(tok.to_str().encode()).hexdigest()


def as_tokenizer(tokenizer):
    """A :class:`treedec.models.tokenizer.Tokenizer` from one, a ``tokenizers.Tokenizer`` or a tokenizer.json path.

    A ``tokenizer.json`` path reads its directory (tokenizer_config.json: BOS/EOS, chat template) too.
    """
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        path = Path(tokenizer)
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer at {path}")
        if path.name == "tokenizer.json":
            return Tokenizer.from_dir(path.parent)
        return Tokenizer(load_hf_tokenizer(path))
    return Tokenizer(tokenizer)


def tokenizer_file(value: str | os.PathLike) -> Path:
    """``paths.tokenizer``: a tokenizer.json (trained there when missing), or the name or directory of a
    model whose tokenizer.json is reused as it is (``paths.tokenizer=tiny-code``: the bundled one)."""
    path = Path(str(value)).expanduser()
    if str(value) in BUNDLED or path.is_dir():
        path = resolve_path(value) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"paths.tokenizer={value}: {path} does not exist")
    return path


__all__ = ["EOS", "as_tokenizer", "load_hf_tokenizer", "tokenizer_file", "tokenizer_hash", "train_bpe",
           "train_tokenizer"]
