"""Test-wide setup and the session fixtures every test directory shares.

* the Triton interpreter must be on before any kernel is defined (no GPU);
* ``$TREEDEC_CACHE``: a fresh folder, so tree=auto's step-cost profiles never touch the user's cache;
* ``corpus``, ``tokenizer``: a synthetic ``*.py`` corpus and the BPE trained on its train split
  (val_fraction 0.2), built once per session;
* ``tiny_target``, ``tiny_head``: a random target and an untrained draft head bound to it
  (:func:`tests.helpers.make_pair`), shared read-only: a test that changes weights builds its own;
* ``stack``: the checkpoints the entry-point tests (generate, regenerate, calibrate, sweeps, bench) load: a tiny
  target, its untrained head, a one-layer assistant, a prompts file and a learned tree; shared read-only (a test
  adding a file there gives it a name of its own);
* ``a_file``: a plain file, where a directory is expected.

``pytest -m "not slow"`` is the quick loop; CI runs everything.
"""
import os
import tempfile

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# tree=auto keeps step-cost profiles in the user's cache: the suite (and its subprocesses) keeps its own
os.environ["TREEDEC_CACHE"] = tempfile.mkdtemp(prefix="treedec-test-cache-")

# Tiny models are dominated by dispatch overhead, and a second thread only adds contention
# when the machine is shared (e.g. with a training job): keep the suite single-threaded.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread in every test, whatever an earlier test set (a 2-thread bf16 matmul of a tiny
    model can take ~10 ms on a busy machine, from OpenMP barrier stalls)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    from tests.helpers import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="session")
def tokenizer(corpus, tmp_path_factory):
    """``(tokenizer.json path, tokenizers.Tokenizer)``: vocabulary 384, ``<|endoftext|>`` = 0."""
    from treedec.data.tokenizer_train import train_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return path, train_tokenizer(corpus, vocab_size=384, val_fraction=0.2, out=path)


@pytest.fixture(scope="session")
def tiny_pair():
    from tests.helpers import make_pair

    return make_pair(seed=0)


@pytest.fixture(scope="session")
def tiny_target(tiny_pair):
    return tiny_pair[0]


@pytest.fixture(scope="session")
def tiny_head(tiny_pair):
    return tiny_pair[1]


@pytest.fixture(scope="session")
def stack(tokenizer, tmp_path_factory):
    import json

    from tests.helpers import TINY_ARCH, save_tiny_stack
    from treedec.models import LlamaConfig, Transformer
    from treedec.models.checkpoint import save_pretrained

    root = tmp_path_factory.mktemp("stack")
    save_tiny_stack(root, tokenizer[0])
    # hf_assisted's assistant: 1 layer, the same tokenizer (as tiny-code-assistant is for tiny-code).
    small = Transformer(LlamaConfig(**{**TINY_ARCH, "num_hidden_layers": 1, "max_position_embeddings": 256}), "sdpa")
    save_pretrained(small, root / "assistant", tokenizer=str(tokenizer[0]))
    (root / "prompts.jsonl").write_text(json.dumps({"id": "add", "prompt": "def add(a, b):\n"}) + "\n\n"
                                        + json.dumps({"prompt": "class Thing:\n    def get(self):\n"}) + "\n")
    (root / "learned.yaml").write_text("choices: [[0], [1], [0, 0], [0, 0, 0]]\n")
    return root


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory\n")
    return path
