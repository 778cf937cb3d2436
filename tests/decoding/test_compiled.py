"""compile=true: greedy output of the compiled paths is the eager output, token for token, in fp32."""
import pytest

from tests.helpers import OraclePolicy, greedy_reference, make_pair
from treedec.decoding import vanilla
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.tree.policies import StaticPolicy


@pytest.mark.slow
def test_compiled_vanilla_and_speculative_equal_eager():
    target, draft = make_pair(8, hidden=32, heads=2, kv_heads=1)
    prompts = [list(range(3, 20)), [5, 1, 4]]
    refs = [greedy_reference(target, p, 40) for p in prompts]
    dec = vanilla.VanillaDecoder(target, compile=True)
    assert [dec.generate(p, 40).tokens[0] for p in prompts] == refs  # a second prompt length: no recompile needed
    oracle = OraclePolicy(StaticPolicy(shape="balanced_2x3"), [refs[0]], p_hit=0.8)
    spec = SpeculativeDecoder(target, draft, oracle, compile=True)
    res = spec.generate(prompts[0], 40, stream=oracle.stream)
    assert res.tokens[0] == refs[0] and res.stats.tau > 1.5


@pytest.mark.slow
def test_compiled_decoders_refill_slots_from_a_queue():
    """serve() with compile=True keeps the batch's shape (no compaction) and refills finished rows' slots: every
    prompt's tokens are still its eager greedy ones."""
    target, draft = make_pair(8, hidden=32, heads=2, kv_heads=1)
    prompts = [list(range(3, 20)), [5, 1, 4], [7, 7, 2, 9, 30, 11], [12] * 9]
    refs = [greedy_reference(target, p, 30) for p in prompts]
    eos = [refs[1][11]]  # prompt 1 stops early (at the latest at its 12th token), so its slot is refilled first
    want = [vanilla.VanillaDecoder(target, eos_ids=eos).generate([p], 30).tokens[0] for p in prompts]
    assert len({len(t) for t in want}) > 1
    for dec in (vanilla.VanillaDecoder(target, eos_ids=eos, compile=True),
                SpeculativeDecoder(target, draft, StaticPolicy(shape="balanced_2x3"), eos_ids=eos, compile=True)):
        got = dec.serve(prompts, 30, slots=2)
        assert got.tokens == want and got.stats.prefills >= 2 and dec.cache.batch == 2
