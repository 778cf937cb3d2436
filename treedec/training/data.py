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

The user's own corpus, one JSON object per line (``{"text": ...}`` or ShareGPT-style
``{"conversations": [{"from": "human", "value": ...}, ...]}``):

* :func:`tokenize_jsonl` renders chat with the tokenizer's chat template (or a documented fallback,
  :class:`ChatRenderer`), marks the tokens of assistant turns, and caches tokens + mask memory-mapped
  under ``cache_dir/jsonl/<settings>-<file sha1>/``;
* :class:`JsonlDataModule` serves text as windows (like the stdlib) and chat as one padded sequence
  per conversation with ``loss_mask`` / ``attention_mask``.
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
    root = Path(root) if root else stdlib_root()
    files = split_files(root, "train", val_fraction)
    return train_bpe((read_source(root, f) for f in files), vocab_size, out, length=len(files))


def train_bpe(texts, vocab_size: int = 8192, out: str | os.PathLike | None = None, length: int | None = None):
    """The byte-level BPE of :func:`train_tokenizer`, trained on any iterable of texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    eos_id = tok.token_to_id(EOS)
    tok.post_processor = processors.TemplateProcessing(single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B",
                                                       special_tokens=[(EOS, eos_id)])
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{out}.tmp{os.getpid()}")
        tok.save(str(tmp))
        os.replace(tmp, out)  # atomic: a reader (another rank) never sees half a file
    return tok


def _process_rank() -> int:
    """The global rank from the launcher's environment (RANK, LOCAL_RANK, SLURM_PROCID), 0 outside DDP."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return int(getattr(rank_zero_only, "rank", 0) or 0)


def wait_for_rank_zero(path: str | os.PathLike, what: str, timeout_s: float = 3600.0) -> None:
    """On ranks > 0 of a multi-process job, wait for rank 0 to write ``path`` instead of building it too.

    ``treedec.pretrain`` prepares the data before the Trainer (and its process group) exists. Under
    Lightning's own DDP launcher the other ranks start after that, so the file is there; when srun or
    torchrun starts every rank at once, each would train its own tokenizer (BPE ties may break
    differently) into the same path: ranks > 0 wait for rank 0's instead.
    """
    import time

    path = Path(path)
    t0 = time.time()
    while not path.is_file():
        if time.time() - t0 > timeout_s:
            raise TimeoutError(f"rank {_process_rank()}: waited {timeout_s:.0f} s for rank 0 to write the {what} "
                               f"{path} (is it on a file system all ranks share?)")
        time.sleep(0.25)


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
    tag = f".tmp{os.getpid()}"  # concurrent builders (DDP ranks) write their own temporaries
    for split in ("train", "validation"):
        files = split_files(root, split, val_fraction)
        parts = []
        for i in range(0, len(files), 64):
            chunk = files[i:i + 64]
            encs = tok.encode_batch([read_source(root, f) for f in chunk], add_special_tokens=False)
            for e in encs:
                parts.append(np.array([eos] + e.ids, dtype=dtype))
        arr = np.concatenate(parts + [np.array([eos], dtype=dtype)]) if parts else np.array([eos], dtype=dtype)
        tmp = d / f"{split}.bin{tag}"
        arr.tofile(tmp)
        os.replace(tmp, d / f"{split}.bin")
        meta["splits"][split] = {"files": len(files), "tokens": int(arr.size)}
    tmp = d / f"meta.json{tag}"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, d / "meta.json")  # last: its presence marks a complete cache
    return d


def open_tokens(token_dir: str | os.PathLike, split: str) -> np.memmap:
    meta = json.loads((Path(token_dir) / "meta.json").read_text())
    return np.memmap(Path(token_dir) / f"{split}.bin", dtype=np.dtype(meta["dtype"]), mode="r")


# --------------------------------------------------------------------------- datasets
def frequent_tokens(windows: "TokenWindows", k: int, vocab_size: int) -> np.ndarray:
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


def window_loader(windows: "TokenWindows", n_tokens: int, seq_len: int, batch_size: int, seed: int,
                  num_workers: int) -> DataLoader:
    """Random token windows; an "epoch" is n_tokens / seq_len windows, rounded down to whole batches."""
    per_epoch = max(batch_size, n_tokens // seq_len)
    per_epoch -= per_epoch % batch_size
    sampler = RandomWindowSampler(len(windows), per_epoch, seed)
    return ResumableLoader(windows, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=num_workers,
                           generator=loader_generator(seed))


def eval_loader(dataset: Dataset, indices: list[int], batch_size: int, num_workers: int) -> DataLoader:
    """Validation batches in a fixed order."""
    return DataLoader(dataset, batch_size=batch_size, sampler=indices, num_workers=num_workers,
                      generator=loader_generator(0))


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
            if _process_rank() > 0:
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


# --------------------------------------------------------------------------- jsonl corpus
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
FALLBACK_HEADERS = {"system": "System:\n", "user": "User:\n", "assistant": "Assistant:\n"}
_JSONL_VERSION = "jsonl-v1"  # bump when the rendering, masking or cache layout changes


def parse_record(obj, where: str) -> tuple[str, str | list[dict]]:
    """One parsed JSONL line as ``("text", str)`` or ``("chat", [{"role", "content"}, ...])``.

    Chat lines are ShareGPT-style ``{"conversations": [{"from": "human", "value": ...}, ...]}``
    (``"role"``/``"content"`` and a ``"messages"`` list are accepted too); roles ``human``/``user``,
    ``gpt``/``assistant`` and ``system`` map to user, assistant and system. ``where`` names the
    line in error messages.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    conv = obj.get("conversations", obj.get("messages"))
    if conv is not None:
        if not isinstance(conv, list) or not conv:
            raise ValueError(f"{where}: 'conversations' must be a non-empty list of turns")
        msgs = []
        for k, turn in enumerate(conv):
            if not isinstance(turn, dict):
                raise ValueError(f"{where}: turn {k} is a {type(turn).__name__}, not an object")
            role = turn.get("from", turn.get("role"))
            content = turn.get("value", turn.get("content"))
            if role is None or content is None:
                raise ValueError(f"{where}: turn {k} needs 'from' (or 'role') and 'value' (or 'content'); "
                                 f"it has {sorted(turn)}")
            if not isinstance(content, str):
                raise ValueError(f"{where}: turn {k}: the content must be a string, not {type(content).__name__}")
            r = ROLES.get(str(role).strip().lower())
            if r is None:
                raise ValueError(f"{where}: turn {k} has unknown role {role!r}; known roles: human/user, "
                                 f"gpt/assistant, system")
            msgs.append({"role": r, "content": content})
        return "chat", msgs
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise ValueError(f"{where}: 'text' must be a string, not {type(obj['text']).__name__}")
        return "text", obj["text"]
    raise ValueError(f"{where}: a line needs a 'text' string or a 'conversations' list; it has keys {sorted(obj)}")


def read_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, bytes, str, str | list[dict]]]:
    """``(line number, raw line, kind, payload)`` for every non-blank line; clear errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"jsonl corpus {path} does not exist (data.path / data.val_path)")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            raw = raw.strip()
            if not raw:
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ValueError(f"{where}: not valid JSON ({exc})") from exc
            kind, payload = parse_record(obj, where)
            yield lineno, raw, kind, payload


def _line_split(raw: bytes, val_fraction: float) -> str:
    """'validation' for about ``val_fraction`` of the lines, by a SHA-1 of the line's bytes; else 'train'."""
    return "validation" if int.from_bytes(hashlib.sha1(raw).digest()[:8], "big") / 2**64 < val_fraction else "train"


def file_fingerprint(path: str | os.PathLike) -> str:
    h = hashlib.sha1()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _as_treedec_tokenizer(tokenizer):
    """A :class:`treedec.models.tokenizer.Tokenizer` from one, a ``tokenizers.Tokenizer`` or a tokenizer.json path.

    A ``tokenizer.json`` path reads its directory (tokenizer_config.json: BOS/EOS, chat template) too.
    """
    from treedec.models.tokenizer import Tokenizer

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
        self.tok = _as_treedec_tokenizer(tokenizer)
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
        if self.template is None:
            return self._fallback(messages, add_generation_prompt)[0]
        from treedec.models.tokenizer import render_chat_template

        return render_chat_template(self.template, messages, add_generation_prompt=add_generation_prompt,
                                    **self.tok._special_tokens())

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
        except Exception as exc:
            raise ValueError(f"{where}: the chat template failed on this conversation ({exc}); "
                             f"fix the data or set data.chat_template=fallback") from exc
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


def spans_to_mask(offsets, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Per-token bool: the token's characters ``[start, end)`` overlap an assistant span."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(off), dtype=bool)
    for s, e in spans:
        mask |= (off[:, 0] < e) & (off[:, 1] > s)
    return mask


def _encode_texts(tok, texts: list[str]) -> list[list[int]]:
    """``tok.encode(text)`` for each text (BOS as the checkpoint adds it), batched, plus an EOS at the end
    unless the encoding already starts with EOS (then EOS separates documents, as in the stdlib stream)."""
    eos = tok.eos_ids[0] if tok.eos_ids else tok.token_to_id(EOS)
    out = []
    for enc in tok.tk.encode_batch(texts, add_special_tokens=True):
        ids = list(enc.ids)
        if tok.tokenizer_config.get("add_bos_token") and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids = [tok.bos_id] + ids
        if eos is not None and (not ids or ids[0] != eos):
            ids.append(eos)
        out.append(ids)
    return out


def tokenize_jsonl(tokenizer, path: str | os.PathLike, val_path: str | os.PathLike | None = None,
                   val_fraction: float = 0.02, format: str = "auto", chat_template: str | None = "auto",
                   cache_dir: str | os.PathLike | None = None, chunk: int = 512) -> Path:
    """Tokenise a JSONL corpus once into ``<cache_dir>/jsonl/<settings>-<file>/``; reuse it afterwards.

    Per split (``train``, ``validation``): ``<split>.tokens.bin`` (uint16/uint32, documents back to
    back), ``<split>.mask.bin`` (uint8 per token, chat only: 1 = assistant token) and
    ``<split>.offsets.npy`` (int64 ``[n_docs + 1]`` document starts). ``meta.json`` is written last,
    so a directory without it is an interrupted build and is redone. The key covers the tokenizer,
    the chat rendering, the split settings and the SHA-1 of the file(s). Without ``val_path`` a line
    is validation when the SHA-1 of its bytes falls below ``val_fraction`` (deterministic, and
    duplicate lines share a split).
    """
    tok = _as_treedec_tokenizer(tokenizer)
    renderer = ChatRenderer(tok, chat_template)
    if format not in ("auto", "text", "chat"):
        raise ValueError(f"format must be auto, text or chat, not {format!r}")
    path = Path(path)
    sources = [(path, None)] + ([(Path(val_path), "validation")] if val_path else [])
    for src, _ in sources:
        if not src.is_file():
            raise FileNotFoundError(f"jsonl corpus {src} does not exist (data.path / data.val_path)")
    settings = hashlib.sha1("\0".join([_JSONL_VERSION, tokenizer_hash(tok.tk), renderer.fingerprint, format,
                                       repr(float(val_fraction)), str(bool(val_path))]).encode()).hexdigest()
    files = hashlib.sha1("\0".join(file_fingerprint(src) for src, _ in sources).encode()).hexdigest()
    cache_dir = Path(cache_dir) if cache_dir else DEFAULT_CACHE
    d = cache_dir / "jsonl" / f"{settings[:16]}-{files[:16]}"
    if (d / "meta.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    vocab = tok.vocab_size
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    tag = f".tmp{os.getpid()}"
    splits = ("train", "validation")
    fh = {(sp, part): open(d / f"{sp}.{part}.bin{tag}", "wb") for sp in splits for part in ("tokens", "mask")}
    offsets = {sp: [0] for sp in splits}
    stats = {sp: {"files": 0, "docs": 0, "tokens": 0, "assistant_tokens": 0, "no_assistant": 0} for sp in splits}
    kind_seen: list = [None if format == "auto" else format, None]  # kind, where it was decided

    def flush(batch):
        if not batch:
            return
        kind = kind_seen[0]
        if kind == "text":
            encs = _encode_texts(tok, [payload for _, _, payload in batch])
            masks = [None] * len(encs)
        else:
            rendered = [renderer(payload, where) for where, _, payload in batch]
            encs, masks = [], []
            for (text, spans), enc in zip(rendered, tok.tk.encode_batch([t for t, _ in rendered],
                                                                        add_special_tokens=False)):
                encs.append(enc.ids)
                masks.append(spans_to_mask(enc.offsets, spans))
        for (where, sp, _), ids, m in zip(batch, encs, masks):
            arr = np.asarray(ids, dtype=dtype)
            arr.tofile(fh[sp, "tokens"])
            if m is not None:
                m.astype(np.uint8).tofile(fh[sp, "mask"])
                stats[sp]["assistant_tokens"] += int(m.sum())
                stats[sp]["no_assistant"] += int(not m.any())
            offsets[sp].append(offsets[sp][-1] + len(ids))
            stats[sp]["docs"] += 1
            stats[sp]["tokens"] += len(ids)
        batch.clear()

    try:
        batch: list = []
        for src, forced in sources:
            for lineno, raw, kind, payload in read_jsonl(src):
                where = f"{src}:{lineno}"
                if kind_seen[0] is None:
                    kind_seen[:] = [kind, where]
                if kind != kind_seen[0]:
                    first = f" (decided by {kind_seen[1]})" if kind_seen[1] else f" (data.format={format})"
                    raise ValueError(f"{where}: a {kind} line in a {kind_seen[0]} corpus{first}; one file holds one "
                                     f"kind: plain text ('text') or chat ('conversations')")
                sp = forced or ("train" if val_path else _line_split(raw, val_fraction))
                batch.append((where, sp, payload))
                if len(batch) >= chunk:
                    flush(batch)
        flush(batch)
        if kind_seen[0] is None:
            raise ValueError(f"{path} holds no records (every line is blank)")
    except BaseException:
        for f in fh.values():
            f.close()
            Path(f.name).unlink(missing_ok=True)
        try:
            d.rmdir()  # only if nothing else (another process's build) is in it
        except OSError:
            pass
        raise
    finally:
        for f in fh.values():
            f.close()
    kind = kind_seen[0]
    for sp in splits:
        stats[sp]["files"] = stats[sp]["docs"]
        os.replace(d / f"{sp}.tokens.bin{tag}", d / f"{sp}.tokens.bin")
        if kind == "chat":
            os.replace(d / f"{sp}.mask.bin{tag}", d / f"{sp}.mask.bin")
        else:
            os.remove(d / f"{sp}.mask.bin{tag}")
        np.save(d / f"{sp}.offsets{tag}.npy", np.asarray(offsets[sp], dtype=np.int64))
        os.replace(d / f"{sp}.offsets{tag}.npy", d / f"{sp}.offsets.npy")
    eos = tok.eos_ids[0] if tok.eos_ids else tok.token_to_id(EOS)
    meta = {"version": _JSONL_VERSION, "format": kind, "source": str(path),
            "val_source": str(val_path) if val_path else None, "val_fraction": val_fraction,
            "dtype": np.dtype(dtype).name, "vocab_size": vocab, "eos_id": eos,
            "bos_id": tok.bos_id, "pad_id": tok.pad_id, "chat_template": renderer.source if kind == "chat" else None,
            "splits": stats}
    tmp = d / f"meta.json{tag}"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, d / "meta.json")
    return d


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


class ShuffleSampler(Sampler[int]):
    """A permutation of ``range(n)`` from ``seed`` and the epoch (Lightning calls set_epoch)."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist())


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

    def __init__(self, path: str, tokenizer_path: str, val_path: str | None = None, format: str = "auto",
                 chat_template: str | None = "auto", chat_mask: bool = True, seq_len: int = 512,
                 batch_size: int = 8, val_fraction: float = 0.02, cache_dir: str | None = None, seed: int = 0,
                 max_val_windows: int | None = 64, num_workers: int = 0, vocab_size: int = 0,
                 pad_id: int | None = None):
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
                if not self.val_path and _line_split(raw, self.val_fraction) == "validation":
                    continue
                yield payload if kind == "text" else "\n\n".join(m["content"] for m in payload)

        train_bpe(texts(), self.vocab_size, out=self.tokenizer_path)

    def prepare_data(self) -> None:
        if not Path(self.tokenizer_path).is_file():
            if not Path(self.path).is_file():
                raise FileNotFoundError(f"jsonl corpus {self.path} does not exist (data.path)")
            if self.vocab_size and _process_rank() > 0:
                wait_for_rank_zero(self.tokenizer_path, "tokenizer")
            else:
                self._train_tokenizer()
        self.tokenizer = _as_treedec_tokenizer(self.tokenizer_path)
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
                                   sampler=ShuffleSampler(len(self.train_set), self.seed), num_workers=self.num_workers,
                                   generator=loader_generator(self.seed))
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


__all__ = ["EOS", "ROLES", "ChatRenderer", "ChatSequences", "JsonlDataModule", "RandomWindowSampler", "ResumableLoader",
           "ShuffleSampler",
           "StdlibCodeDataModule", "TokenWindows", "corpus_files", "corpus_fingerprint", "file_fingerprint",
           "frequent_tokens", "heldout_prompts", "load_hf_tokenizer", "open_tokens", "parse_record", "read_jsonl", "read_source",
           "spans_to_mask", "split_files", "split_of", "stdlib_root", "tokenize_corpus", "tokenize_jsonl",
           "tokenizer_hash", "train_bpe", "train_tokenizer"]
