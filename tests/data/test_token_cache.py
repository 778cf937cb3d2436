"""The token caches' one writer and one atomic write: complete files or none, and the sampler both loaders use."""
from __future__ import annotations

import json

import numpy as np
import pytest

from treedec.atomic import atomic_file
from treedec.data.datamodules import EpochSampler
from treedec.data.token_cache import TokenWriter, open_tokens, tokenize_corpus


def test_atomic_file_replaces_on_success_and_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    with atomic_file(path) as tmp:
        tmp.write_text("one")
        assert not path.exists()  # invisible until the block ends
    assert path.read_text() == "one"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_file(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert path.read_text() == "one" and [p.name for p in path.parent.iterdir()] == ["f.txt"]


def test_token_writer_writes_tokens_mask_and_offsets_or_nothing(tmp_path):
    files = (tmp_path / "t.bin", tmp_path / "m.bin", tmp_path / "o.npy")
    with TokenWriter(*files[:1], np.uint16, *files[1:]) as w:
        w.add([5, 6, 7], np.array([0, 1, 1], bool))
        w.add([8], np.array([0], bool))
    assert np.fromfile(files[0], np.uint16).tolist() == [5, 6, 7, 8]
    assert np.fromfile(files[1], np.uint8).tolist() == [0, 1, 1, 0]
    assert np.load(files[2]).tolist() == [0, 3, 4] and (w.n_tokens, w.n_masked, w.n_unmasked_docs) == (4, 2, 1)
    for f in files:
        f.unlink()
    with pytest.raises(KeyError):
        with TokenWriter(*files[:1], np.uint16, *files[1:]) as w:
            w.add([1, 2], np.array([1, 1], bool))
            raise KeyError("interrupted")
    assert list(tmp_path.iterdir()) == []  # no partial file, no temporary


def test_the_stdlib_cache_is_eos_separated_files_and_meta_last(corpus, tokenizer, tmp_path):
    _, tok = tokenizer
    d = tokenize_corpus(tok, corpus, 0.2, tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    for split in ("train", "validation"):
        toks = np.asarray(open_tokens(d, split))
        assert toks.size == meta["splits"][split]["tokens"] and toks[0] == toks[-1] == 0
        assert int((toks == 0).sum()) == meta["splits"][split]["files"] + 1  # one EOS before each file, one at the end
    assert sorted(p.name for p in d.iterdir()) == ["meta.json", "train.bin", "validation.bin"]


def test_one_sampler_for_windows_and_conversations():
    perm = EpochSampler(10, seed=3)
    draws = EpochSampler(10, 25, seed=3)
    assert sorted(perm) == list(range(10)) and len(draws) == 25 and all(0 <= i < 10 for i in draws)
    assert list(perm) == list(EpochSampler(10, seed=3))  # seeded
    first = list(perm)
    perm.set_epoch(1)
    assert list(perm) != first and sorted(perm) == list(range(10))  # a new order each epoch
