"""The training tests' session fixtures: ``target_dir``, a saved tiny target (:data:`tests.helpers.TINY_ARCH`, context
64) with the session's tokenizer, which draft jobs train a head for; ``chat_file``, 24 ShareGPT/OpenAI-style
conversations in one jsonl file. Both are shared read-only."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import TINY_ARCH
from tests.training.jobs import conversation, write_jsonl


@pytest.fixture(scope="session")
def target_dir(tokenizer, tmp_path_factory):
    from treedec.models.checkpoint import save_pretrained
    from treedec.models.config import LlamaConfig
    from treedec.models.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(LlamaConfig(**TINY_ARCH), "sdpa")
    out = tmp_path_factory.mktemp("target")
    save_pretrained(model, out, tokenizer=str(tokenizer[0]))
    return out


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("jsonl") / "chat.jsonl", [conversation(i) for i in range(24)])
