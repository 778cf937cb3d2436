"""One draft head object in two decoders: each decoder drafts with its own target's embedding and LM head."""
import copy

import pytest
import torch

from treedec.decoding.speculative import SpeculativeDecoder
from treedec.heads import load_head
from treedec.models import load_model
from treedec.tree.policies import ChainPolicy


def run(target, head, prompt):
    out = SpeculativeDecoder(target, head, ChainPolicy(depth=4), eos_ids=[]).generate(prompt, 24)
    return out.tokens[0], out.stats.accepted


@pytest.mark.filterwarnings("ignore:draft head was trained for target")  # (the rolled embedding: a fingerprint of its own)
def test_a_head_bound_to_a_second_decoder_still_drafts_for_the_first():
    first = load_model("tiny-code")
    second = load_model("tiny-code")
    with torch.no_grad():  # same shape, another embedding: the head drafts other tokens against it
        second.model.embed_tokens.weight.copy_(second.model.embed_tokens.weight.roll(1, 0))
    head = load_head("tiny-code-eagle")
    prompt = list(range(40, 60))
    ref_first = run(first, copy.deepcopy(head).bind(first), prompt)  # each on a head of its own
    ref_second = run(second, copy.deepcopy(head).bind(second), prompt)
    assert ref_first[1] != ref_second[1]  # (the test can tell the bindings apart)
    dec_first = SpeculativeDecoder(first, head, ChainPolicy(depth=4), eos_ids=[])
    dec_second = SpeculativeDecoder(second, head, ChainPolicy(depth=4), eos_ids=[])
    for dec, ref in ((dec_first, ref_first), (dec_second, ref_second), (dec_first, ref_first)):
        out = dec.generate(prompt, 24)
        assert (out.tokens[0], out.stats.accepted) == ref
