"""Datasets over the memory-mapped token caches: windows of a token stream, and one conversation each."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset


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


class ChatSequences(Dataset):
    """Conversation ``docs[i]`` as ``{"input_ids", "loss_mask", "attention_mask"}``, each ``[seq_len + 1]``:
    truncated to ``seq_len + 1`` tokens, right-padded with ``pad_id`` (mask and attention 0 there)."""

    def __init__(self, token_dir: str | os.PathLike, split: str, dtype: str, seq_len: int, pad_id: int,
                 docs: np.ndarray | None = None):
        self.dir, self.split, self.dtype, self.seq_len, self.pad_id = str(token_dir), split, dtype, seq_len, pad_id
        self.offsets = np.load(Path(token_dir) / f"{split}.offsets.npy")
        self.docs = np.arange(len(self.offsets) - 1) if docs is None else np.asarray(docs)
        self._mm = None

    def __len__(self) -> int:
        return len(self.docs)

    def _maps(self):
        if self._mm is None:
            d = Path(self.dir)
            self._mm = (np.memmap(d / f"{self.split}.tokens.bin", dtype=np.dtype(self.dtype), mode="r"),
                        np.memmap(d / f"{self.split}.mask.bin", dtype=np.uint8, mode="r"))
        return self._mm

    def __getitem__(self, i: int) -> dict:
        toks, mask = self._maps()
        doc = int(self.docs[i])
        s, e = int(self.offsets[doc]), int(self.offsets[doc + 1])
        S = self.seq_len + 1
        n = min(e - s, S)
        ids = np.full(S, self.pad_id, dtype=np.int64)
        ids[:n] = toks[s:s + n]
        lm = np.zeros(S, dtype=bool)
        lm[:n] = mask[s:s + n] != 0
        att = np.zeros(S, dtype=bool)
        att[:n] = True
        return {"input_ids": torch.from_numpy(ids), "loss_mask": torch.from_numpy(lm),
                "attention_mask": torch.from_numpy(att)}

    def __getstate__(self):
        return {**self.__dict__, "_mm": None}


def frequent_tokens(windows: TokenWindows, k: int, vocab_size: int) -> np.ndarray:
    """The ``k`` most frequent token ids of a token file, most frequent first (a draft vocabulary).

    EAGLE-3 drafts over the training data's most frequent target tokens; a head whose LM head
    multiplies by k rows instead of the whole vocabulary drafts faster and, on code, accepts
    as much (the rare tokens it drops are ones it would seldom guess).
    """
    if not 0 < k <= vocab_size:
        raise ValueError(f"draft_vocab_size={k} must be in [1, {vocab_size}] (0 turns it off)")
    tokens = np.memmap(windows.path, dtype=np.dtype(windows.dtype), mode="r")
    counts = np.bincount(tokens, minlength=vocab_size)[:vocab_size]
    return np.argsort(-counts, kind="stable")[:k]


__all__ = ["ChatSequences", "TokenWindows", "frequent_tokens"]
