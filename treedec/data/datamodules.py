"""The Lightning data modules: the stdlib corpus and the user's JSON-lines corpus, as resumable loaders.

Training batches come from one seeded :class:`EpochSampler` (random windows, or a permutation of the
conversations) through a :class:`ResumableLoader`, so a job killed mid-epoch resumes with the batches
an uninterrupted one would have drawn; validation batches come in a fixed order.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterator

import lightning as L
import numpy as np
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torch.utils.data import DataLoader, Dataset, Sampler

from treedec.conf_defaults import shipped_defaults
from treedec.data.corpus import line_split, read_jsonl
from treedec.data.datasets import ChatSequences, TokenWindows
from treedec.data.prompts import heldout_prompts
from treedec.data.token_cache import tokenize_corpus, tokenize_jsonl
from treedec.data.tokenizer_train import as_tokenizer, load_hf_tokenizer, train_bpe, train_tokenizer


# --------------------------------------------------------------------------- ranks
def process_rank() -> int:
    """The global rank from the launcher's environment (RANK, LOCAL_RANK, SLURM_PROCID), 0 outside DDP."""
    return int(getattr(rank_zero_only, "rank", 0) or 0)


def wait_for_rank_zero(path: str | os.PathLike, what: str, timeout_s: float = 3600.0) -> None:
    """On ranks > 0 of a multi-process job, wait for rank 0 to write ``path`` instead of building it too.

    ``treedec.pretrain`` prepares the data before the Trainer (and its process group) exists. Under
    Lightning's own DDP launcher the other ranks start after that, so the file is there; when srun or
    torchrun starts every rank at once, each would train its own tokenizer (BPE ties may break
    differently) into the same path: ranks > 0 wait for rank 0's instead.
    """
    path = Path(path)
    t0 = time.time()
    while not path.is_file():
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"rank {process_rank()}: waited {timeout_s:.0f} s for rank 0 to write the {what} "
                               f"{path} (is it on a file system all ranks share?)")
        time.sleep(0.25)


# --------------------------------------------------------------------------- sampling and loading
class EpochSampler(Sampler[int]):
    """Indices into ``range(n)`` drawn from ``seed`` and the epoch (Lightning calls :meth:`set_epoch`).

    ``num_samples=None``: a permutation of ``range(n)`` (each conversation once an epoch); else
    ``num_samples`` uniform draws with replacement (random window starts).
    """

    def __init__(self, n: int, num_samples: int | None = None, seed: int = 0):
        self.n, self.num_samples, self.seed, self.epoch = n, num_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n if self.num_samples is None else self.num_samples

    def __iter__(self) -> Iterator[int]:
        rng = np.random.default_rng([self.seed, self.epoch])
        if self.num_samples is None:
            return iter(rng.permutation(self.n).tolist())
        return iter(rng.integers(0, self.n, size=self.num_samples).tolist())


class ResumableLoader(DataLoader):
    """A DataLoader that knows how far into its epoch it is, so a resumed job goes on from there.

    Lightning stores :meth:`state_dict` (the sampler's epoch and the batches handed out in it) in
    every checkpoint and calls :meth:`load_state_dict` on resume; the first iteration of that epoch
    then skips the batches already trained on (their indices are drawn and dropped, so the sampler
    ends the epoch exactly where an uninterrupted run would). Works under Lightning's distributed
    sampler too (each rank skips its own batches).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._epoch, self._served, self._resume = None, 0, None

    def _sampler_epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", 0))

    def state_dict(self) -> dict:
        return {"epoch": self._epoch if self._epoch is not None else self._sampler_epoch(), "batches": self._served}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = (int(state_dict["epoch"]), int(state_dict["batches"]))

    def __iter__(self):
        return self._iterate(super().__iter__())

    def _iterate(self, it):
        # The sampler's epoch is set by Lightning after iter() and before the first batch: read it here.
        self._epoch, self._served = self._sampler_epoch(), 0
        resume, self._resume = self._resume, None
        if resume is not None and resume[0] == self._epoch:
            for _ in range(resume[1]):
                if next(it, None) is None:
                    return
                self._served += 1
        for batch in it:
            self._served += 1
            yield batch


def loader_generator(seed: int) -> torch.Generator:
    """A loader's own generator: creating its iterator then draws no number from torch's global RNG
    (which would shift every later random draw of a resumed run against an uninterrupted one)."""
    return torch.Generator().manual_seed(int(seed))


def window_loader(windows: TokenWindows, n_tokens: int, seq_len: int, batch_size: int, seed: int,
                  num_workers: int) -> DataLoader:
    """Random token windows; an "epoch" is n_tokens / seq_len windows, rounded down to whole batches."""
    per_epoch = max(batch_size, n_tokens // seq_len)
    per_epoch -= per_epoch % batch_size
    sampler = EpochSampler(len(windows), per_epoch, seed)
    return ResumableLoader(windows, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=num_workers,
                           generator=loader_generator(seed))


def eval_loader(dataset: Dataset, indices: list[int], batch_size: int, num_workers: int) -> DataLoader:
    """Validation batches in a fixed order."""
    return DataLoader(dataset, batch_size=batch_size, sampler=indices, num_workers=num_workers,
                      generator=loader_generator(0))


# --------------------------------------------------------------------------- data modules
# The defaults of data=stdlib_code and data=jsonl, written once in their YAML (the keys it wires to another,
# such as seed: ${seed}, keep a default here for a Python caller)
_STDLIB, _JSONL = shipped_defaults("data/stdlib_code"), shipped_defaults("data/jsonl")


class StdlibCodeDataModule(L.LightningDataModule):
    """Token windows of the stdlib corpus (or any ``root`` of ``*.py`` files).

    Train: random windows of ``seq_len + 1`` tokens (an "epoch" = n_train_tokens / seq_len windows).
    Validation: contiguous, non-overlapping windows (at most ``max_val_windows``).
    """

    def __init__(self, tokenizer_path: str, root: str | None = _STDLIB["root"], seq_len: int = _STDLIB["seq_len"],
                 batch_size: int = _STDLIB["batch_size"], val_fraction: float = _STDLIB["val_fraction"],
                 cache_dir: str | None = _STDLIB["cache_dir"], seed: int = 0,
                 max_val_windows: int | None = _STDLIB["max_val_windows"], num_workers: int = _STDLIB["num_workers"],
                 vocab_size: int = 8192):
        super().__init__()
        self.tokenizer_path, self.root = tokenizer_path, root
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.cache_dir, self.seed, self.max_val_windows = cache_dir, seed, max_val_windows
        self.num_workers, self.vocab_size = num_workers, vocab_size
        self.token_dir: Path | None = None

    def prepare_data(self) -> None:
        if not Path(self.tokenizer_path).is_file():
            if process_rank() > 0:
                wait_for_rank_zero(self.tokenizer_path, "tokenizer")
            else:
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
        return window_loader(self.train_set, self.n_train_tokens, self.seq_len, self.batch_size, self.seed,
                             self.num_workers)

    def val_dataloader(self) -> DataLoader:
        starts = list(range(0, len(self.val_set), self.seq_len))
        if self.max_val_windows:
            starts = starts[: self.max_val_windows]
        return eval_loader(self.val_set, starts, self.batch_size, self.num_workers)

    def eval_prompts(self, n: int, prompt_tokens: int, tokenizer) -> list[list[int]]:
        """Token ids of :func:`heldout_prompts` from this module's validation files (for the τ callback)."""
        texts = heldout_prompts(n, prompt_tokens, self.root, self.val_fraction, tokenizer=tokenizer)
        return [tokenizer.encode(t) for t in texts]


class JsonlDataModule(L.LightningDataModule):
    """The user's own corpus: one JSON object per line, plain text or chat (see :func:`parse_record`).

    Plain text (``{"text": ...}``): documents tokenised back to back (each with the checkpoint's
    BOS and an EOS), served exactly like :class:`StdlibCodeDataModule`: random ``[B, seq_len + 1]``
    windows for training, contiguous ones for validation.

    Chat (``{"conversations": [...]}``): each conversation rendered with the tokenizer's chat
    template (else the :class:`ChatRenderer` fallback format), one sequence per conversation,
    truncated/right-padded to ``seq_len + 1``; batches are dicts ``input_ids`` [B, S] (long),
    ``loss_mask`` [B, S] (bool, True on assistant-turn tokens), ``attention_mask`` [B, S] (bool,
    False on padding). Conversations with no assistant token in their first ``seq_len + 1``
    tokens are skipped. ``chat_mask=False`` serves chat data as plain windows instead (e.g. for
    pretraining on rendered conversations).

    ``tokenizer_path``: the target's ``tokenizer.json`` (its directory's ``tokenizer_config.json``
    gives BOS/EOS/pad and the chat template). When it does not exist and ``vocab_size > 0``, a
    byte-level BPE is trained on the train split's texts and saved there (pretraining).
    Tokenisation is cached by :func:`tokenize_jsonl`.
    """

    def __init__(self, path: str, tokenizer_path: str, val_path: str | None = _JSONL["val_path"],
                 format: str = _JSONL["format"], chat_template: str | None = _JSONL["chat_template"],
                 chat_mask: bool = _JSONL["chat_mask"], seq_len: int = _JSONL["seq_len"],
                 batch_size: int = _JSONL["batch_size"], val_fraction: float = _JSONL["val_fraction"],
                 cache_dir: str | None = _JSONL["cache_dir"], seed: int = 0,
                 max_val_windows: int | None = _JSONL["max_val_windows"], num_workers: int = _JSONL["num_workers"],
                 vocab_size: int = 0, pad_id: int | None = _JSONL["pad_id"]):
        super().__init__()
        self.path, self.val_path, self.tokenizer_path = str(path), (str(val_path) if val_path else None), tokenizer_path
        self.format, self.chat_template, self.chat_mask = format, chat_template, bool(chat_mask)
        self.seq_len, self.batch_size, self.val_fraction = seq_len, batch_size, val_fraction
        self.cache_dir, self.seed, self.max_val_windows = cache_dir, seed, max_val_windows
        self.num_workers, self.vocab_size, self.pad_id = num_workers, vocab_size, pad_id
        self.root = None
        self.token_dir: Path | None = None

    def _train_tokenizer(self) -> None:
        if not self.vocab_size:
            raise FileNotFoundError(f"no tokenizer at {self.tokenizer_path} (and data.vocab_size is 0, so none is "
                                    f"trained): point data.tokenizer_path at the target's tokenizer.json")

        def texts():  # the train split's texts (conversations: their turns' contents)
            for _, raw, kind, payload in read_jsonl(self.path):
                if not self.val_path and line_split(raw, self.val_fraction) == "validation":
                    continue
                yield payload if kind == "text" else "\n\n".join(m["content"] for m in payload)

        train_bpe(texts(), self.vocab_size, out=self.tokenizer_path)

    def prepare_data(self) -> None:
        if not Path(self.tokenizer_path).is_file():
            if not Path(self.path).is_file():
                raise FileNotFoundError(f"jsonl corpus {self.path} does not exist (data.path)")
            if self.vocab_size and process_rank() > 0:
                wait_for_rank_zero(self.tokenizer_path, "tokenizer")
            else:
                self._train_tokenizer()
        self.tokenizer = as_tokenizer(self.tokenizer_path)
        self.token_dir = tokenize_jsonl(self.tokenizer, self.path, self.val_path, self.val_fraction, self.format,
                                        self.chat_template, self.cache_dir)

    @property
    def is_chat(self) -> bool:
        return self.meta["format"] == "chat"

    def setup(self, stage: str | None = None) -> None:
        if self.token_dir is None:
            self.prepare_data()
        self.meta = json.loads((self.token_dir / "meta.json").read_text())
        dt, S = self.meta["dtype"], self.seq_len + 1
        for sp in ("train", "validation"):
            if self.meta["splits"][sp]["docs"] == 0:
                raise ValueError(f"the {sp} split of {self.path} is empty: "
                                 + ("give data.val_path or raise data.val_fraction" if sp == "validation"
                                    else "the file holds only validation lines"))
        if self.is_chat and self.chat_mask:
            pad = self.pad_id if self.pad_id is not None else next(
                (i for i in (self.meta["pad_id"], self.meta["eos_id"]) if i is not None), 0)
            sets = []
            for sp in ("train", "validation"):
                off = np.load(self.token_dir / f"{sp}.offsets.npy")
                mask = np.memmap(self.token_dir / f"{sp}.mask.bin", dtype=np.uint8, mode="r")
                keep = [i for i in range(len(off) - 1) if mask[off[i]:min(off[i + 1], off[i] + S)].any()]
                if not keep:
                    raise ValueError(f"no conversation of the {sp} split of {self.path} has an assistant token "
                                     f"within its first seq_len + 1 = {S} tokens")
                sets.append(ChatSequences(self.token_dir, sp, dt, self.seq_len, int(pad), np.asarray(keep)))
            self.train_set, self.val_set = sets
        else:
            self.train_set = TokenWindows(self.token_dir / "train.tokens.bin", dt, self.seq_len)
            self.val_set = TokenWindows(self.token_dir / "validation.tokens.bin", dt, self.seq_len)

    @property
    def n_train_tokens(self) -> int:
        return int(self.meta["splits"]["train"]["tokens"])

    def train_dataloader(self) -> DataLoader:
        if isinstance(self.train_set, ChatSequences):
            return ResumableLoader(self.train_set, batch_size=self.batch_size, drop_last=True,
                                   sampler=EpochSampler(len(self.train_set), seed=self.seed),
                                   num_workers=self.num_workers, generator=loader_generator(self.seed))
        return window_loader(self.train_set, self.n_train_tokens, self.seq_len, self.batch_size, self.seed,
                             self.num_workers)

    def val_dataloader(self) -> DataLoader:
        if isinstance(self.val_set, ChatSequences):
            idx = list(range(len(self.val_set)))
        else:
            idx = list(range(0, len(self.val_set), self.seq_len))
        if self.max_val_windows:
            idx = idx[: self.max_val_windows]
        return eval_loader(self.val_set, idx, self.batch_size, self.num_workers)

    def eval_prompts(self, n: int, prompt_tokens: int, tokenizer=None) -> list[list[int]]:
        """``n`` prompts from evenly spaced validation documents, at most ``prompt_tokens`` tokens each.

        Chat: a conversation's tokens before its first assistant token (the rendered history with
        the generation prompt), cut from the left if longer. Text: a document's first tokens.
        """
        d, dt = self.token_dir, np.dtype(self.meta["dtype"])
        off = np.load(d / "validation.offsets.npy")
        toks = np.memmap(d / "validation.tokens.bin", dtype=dt, mode="r")
        chat = self.is_chat
        mask = np.memmap(d / "validation.mask.bin", dtype=np.uint8, mode="r") if chat else None
        docs = list(range(len(off) - 1))
        if chat:
            docs = [i for i in docs if mask[off[i]:off[i + 1]].any() and mask[off[i]] == 0]
        out = []
        for j in range(min(n, len(docs))):
            i = docs[int(j * len(docs) / min(n, len(docs)))]
            s, e = int(off[i]), int(off[i + 1])
            if chat:
                k = s + int(np.argmax(mask[s:e] != 0))
                ids = toks[max(s, k - prompt_tokens):k]
            else:
                ids = toks[s:min(e, s + prompt_tokens)]
                if len(ids) > 1 and int(ids[-1]) == self.meta["eos_id"]:
                    ids = ids[:-1]
            out.append([int(x) for x in ids])
        return [p for p in out if p]


__all__ = ["EpochSampler", "JsonlDataModule", "ResumableLoader", "StdlibCodeDataModule", "eval_loader",
           "loader_generator", "process_rank", "wait_for_rank_zero", "window_loader"]
