"""Pretraining data: the Python standard library's source as a deterministic code corpus.

* :func:`corpus_files` lists the ``*.py`` files under a root (default: ``sysconfig``'s
  ``stdlib``), skipping ``site-packages``, ``test``/``tests``/``idle_test`` dirs and caches;
  :func:`split_of` assigns each file to ``train`` or ``validation`` by a SHA-1 of its relative
  path, so the split never depends on the machine or on file order.
* :func:`train_tokenizer` trains a byte-level BPE (``<|endoftext|>`` = BOS = EOS) on the train split.
* :func:`tokenize_corpus` writes each split once as a flat ``uint16``/``uint32`` token stream
  (files separated by ``<|endoftext|>``) under ``cache_dir/<tokenizer hash>-<corpus fingerprint>/``
  and memory-maps it afterwards, so later epochs, resumed jobs and other runs don't re-tokenise.
* :class:`StdlibCodeDataModule` serves seeded random ``seq_len + 1`` windows for training and
  contiguous windows for validation.
* :func:`heldout_prompts` gives benchmark prompts (code ending with a ``def`` header) drawn from
  validation files only.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sysconfig
from pathlib import Path
from typing import Iterator, Sequence

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

EOS = "<|endoftext|>"
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
DEFAULT_CACHE = Path(os.environ.get("TREEDEC_CACHE", Path.home() / ".cache" / "treedec"))


# --------------------------------------------------------------------------- corpus
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | os.PathLike | None = None) -> list[str]:
    """Sorted POSIX paths (relative to ``root``) of the corpus's ``*.py`` files."""
    root = Path(root) if root else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        rel = Path(d).relative_to(root)
        out += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(out)


def split_of(relpath: str, val_fraction: float = 0.03) -> str:
    """'validation' for about ``val_fraction`` of the files, by a hash of the path; else 'train'."""
    h = int.from_bytes(hashlib.sha1(relpath.encode()).digest()[:8], "big")
    return "validation" if h / 2**64 < val_fraction else "train"


def split_files(root=None, split: str = "train", val_fraction: float = 0.03) -> list[str]:
    return [f for f in corpus_files(root) if split_of(f, val_fraction) == split]


def read_source(root, relpath: str) -> str:
    return (Path(root) / relpath).read_bytes().decode("utf-8", errors="replace")


def corpus_fingerprint(root=None, val_fraction: float = 0.03) -> str:
    """SHA-1 over every file's path, split and content: changes whenever the corpus does."""
    root = Path(root) if root else stdlib_root()
    h = hashlib.sha1(f"v1 {val_fraction}".encode())
    for f in corpus_files(root):
        h.update(f.encode() + b"\0" + (root / f).read_bytes() + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(root=None, vocab_size: int = 8192, val_fraction: float = 0.03, out: str | os.PathLike | None = None):
    """A byte-level BPE trained on the train split; ``<|endoftext|>`` (id 0) is BOS and EOS.

    Encoding with special tokens prepends ``<|endoftext|>``, the context every file starts
    from in training. Returns the ``tokenizers.Tokenizer`` (and saves it to ``out`` if given).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    root = Path(root) if root else stdlib_root()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    files = split_files(root, "train", val_fraction)
    tok.train_from_iterator((read_source(root, f) for f in files), trainer=trainer, length=len(files))
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B",
                                                       special_tokens=[(EOS, eos_id)])
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(out))
    return tok


def load_hf_tokenizer(path: str | os.PathLike):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def tokenizer_hash(tok) -> str:
    return hashlib.sha1(tok.to_str().encode()).hexdigest()


# --------------------------------------------------------------------------- token cache
def tokenize_corpus(tok, root=None, val_fraction: float = 0.03, cache_dir: str | os.PathLike | None = None) -> Path:
    """Tokenise both splits once into ``<cache_dir>/tokens/<tok>-<corpus>/{train,validation}.bin``.

    Each split is ``EOS f1 EOS f2 ...`` (so every file starts right after an EOS); the dtype
    is recorded in ``meta.json``. Returns the directory; reuses it when it already exists.
    """
    root = Path(root) if root else stdlib_root()
    cache_dir = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    d = cache_dir / "tokens" / f"{tokenizer_hash(tok)[:16]}-{corpus_fingerprint(root, val_fraction)[:16]}"
    if (d / "meta.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    eos = tok.token_to_id(EOS)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    meta = {"root": str(root), "val_fraction": val_fraction, "dtype": np.dtype(dtype).name, "eos_id": eos,
            "vocab_size": vocab, "splits": {}}
    for split in ("train", "validation"):
        files = split_files(root, split, val_fraction)
        parts = []
        for i in range(0, len(files), 64):
            chunk = files[i:i + 64]
            encs = tok.encode_batch([read_source(root, f) for f in chunk], add_special_tokens=False)
            for e in encs:
                parts.append(np.array([eos] + e.ids, dtype=dtype))
        arr = np.concatenate(parts + [np.array([eos], dtype=dtype)]) if parts else np.array([eos], dtype=dtype)
        tmp = d / f"{split}.bin.tmp"
        arr.tofile(tmp)
        os.replace(tmp, d / f"{split}.bin")
        meta["splits"][split] = {"files": len(files), "tokens": int(arr.size)}
    (d / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return d


def open_tokens(token_dir: str | os.PathLike, split: str) -> np.memmap:
    meta = json.loads((Path(token_dir) / "meta.json").read_text())
    return np.memmap(Path(token_dir) / f"{split}.bin", dtype=np.dtype(meta["dtype"]), mode="r")


# --------------------------------------------------------------------------- datasets
class TokenWindows(Dataset):
    """``tokens[start : start + seq_len + 1]`` as int64, indexed by start offset (memory-mapped lazily)."""

    def __init__(self, path: str | os.PathLike, dtype: str, seq_len: int):
        self.path, self.dtype, self.seq_len = str(path), dtype, seq_len
        self._mm = None
        self.n_tokens = os.path.getsize(path) // np.dtype(dtype).itemsize
        if self.n_tokens < seq_len + 1:
            raise ValueError(f"{path} holds {self.n_tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}")

    def __len__(self) -> int:
        return self.n_tokens - self.seq_len

    def __getitem__(self, start: int) -> torch.Tensor:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r")
        return torch.from_numpy(self._mm[start:start + self.seq_len + 1].astype(np.int64))

    def __getstate__(self):
        return {**self.__dict__, "_mm": None}


class RandomWindowSampler(Sampler[int]):
    """``num_samples`` uniformly random window starts, from ``seed`` and the epoch (Lightning calls set_epoch)."""

    def __init__(self, n_starts: int, num_samples: int, seed: int = 0):
        self.n_starts, self.num_samples, self.seed, self.epoch = n_starts, num_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        return iter(rng.integers(0, self.n_starts, size=self.num_samples).tolist())


class StdlibCodeDataModule(L.LightningDataModule):
    """Token windows of the stdlib corpus (or any ``root`` of ``*.py`` files).

    Train: random windows of ``seq_len + 1`` tokens (an "epoch" = n_train_tokens / seq_len windows).
    Validation: contiguous, non-overlapping windows (at most ``max_val_windows``).
    """

    def __init__(self, tokenizer_path: str, root: str | None = None, seq_len: int = 512, batch_size: int = 16,
                 val_fraction: float = 0.03, cache_dir: str | None = None, seed: int = 0,
                 max_val_windows: int | None = 64, num_workers: int = 0, vocab_size: int = 8192):
        super().__init__()
        self.tokenizer_path, self.root = tokenizer_path, root
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.cache_dir, self.seed, self.max_val_windows = cache_dir, seed, max_val_windows
        self.num_workers, self.vocab_size = num_workers, vocab_size
        self.token_dir: Path | None = None

    def prepare_data(self) -> None:
        if not Path(self.tokenizer_path).is_file():
            train_tokenizer(self.root, self.vocab_size, self.val_fraction, out=self.tokenizer_path)
        self.token_dir = tokenize_corpus(load_hf_tokenizer(self.tokenizer_path), self.root, self.val_fraction,
                                         self.cache_dir)

    def setup(self, stage: str | None = None) -> None:
        if self.token_dir is None:
            self.prepare_data()
        self.meta = json.loads((self.token_dir / "meta.json").read_text())
        dt = self.meta["dtype"]
        self.train_set = TokenWindows(self.token_dir / "train.bin", dt, self.seq_len)
        self.val_set = TokenWindows(self.token_dir / "validation.bin", dt, self.seq_len)

    @property
    def n_train_tokens(self) -> int:
        return self.train_set.n_tokens

    def train_dataloader(self) -> DataLoader:
        per_epoch = max(self.batch_size, self.n_train_tokens // self.seq_len)
        per_epoch -= per_epoch % self.batch_size
        sampler = RandomWindowSampler(len(self.train_set), per_epoch, self.seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True,
                          num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        starts = list(range(0, len(self.val_set), self.seq_len))
        if self.max_val_windows:
            starts = starts[: self.max_val_windows]
        return DataLoader(self.val_set, batch_size=self.batch_size, sampler=starts, num_workers=self.num_workers)


# --------------------------------------------------------------------------- prompts
_DEF = re.compile(r"^\s*(async\s+)?def\s+\w+\s*\(.*\)\s*(->\s*[^:]+)?:\s*$")


def heldout_prompts(n: int = 16, prompt_tokens: int = 128, root=None, val_fraction: float = 0.03,
                    tokenizer=None, min_context_lines: int = 3) -> list[str]:
    """``n`` benchmark prompts from validation files: the code before a one-line ``def`` header, header included.

    Each prompt ends right after a function signature (``...:\\n``), so the model continues
    with its docstring/body. With ``tokenizer`` (a ``tokenizers.Tokenizer`` or treedec
    ``Tokenizer``) the leading context is cut to at most ``prompt_tokens`` tokens (on a line
    boundary); without one, to about ``4 * prompt_tokens`` characters. Deterministic: the
    candidates are spaced evenly over all validation functions in path order.
    """
    root = Path(root) if root else stdlib_root()
    cands: list[tuple[str, int]] = []
    sources = {}
    for f in split_files(root, "validation", val_fraction):
        lines = read_source(root, f).splitlines(keepends=True)
        sources[f] = lines
        cands += [(f, i) for i, ln in enumerate(lines) if i >= min_context_lines and _DEF.match(ln)]
    if not cands:
        return []
    pick = [cands[int(j * len(cands) / min(n, len(cands)))] for j in range(min(n, len(cands)))]

    def count(text: str) -> int:
        if tokenizer is None:
            return (len(text) + 3) // 4
        enc = tokenizer.encode(text, add_special_tokens=False) if hasattr(tokenizer, "encode_batch") \
            else tokenizer.encode(text, add_bos=False)
        return len(enc.ids if hasattr(enc, "ids") else enc)

    out = []
    for f, i in pick:
        lines = sources[f]
        start = i
        while start > 0 and count("".join(lines[start - 1:i + 1])) <= prompt_tokens:
            start -= 1
        text = "".join(lines[start:i + 1])
        if not text.endswith("\n"):
            text += "\n"
        out.append(text)
    return out


__all__ = ["EOS", "RandomWindowSampler", "StdlibCodeDataModule", "TokenWindows", "corpus_files", "corpus_fingerprint",
           "heldout_prompts", "load_hf_tokenizer", "open_tokens", "read_source", "split_files", "split_of",
           "stdlib_root", "tokenize_corpus", "tokenizer_hash", "train_tokenizer"]
