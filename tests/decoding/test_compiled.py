"""compile=true: greedy output of the compiled paths is the eager output, token for token, in fp32."""
import pytest

from treedec.decoding import vanilla
from treedec.decoding.speculative import SpeculativeDecoder
from treedec.tree.policies import StaticPolicy

from tests.helpers import OraclePolicy, greedy_reference, make_pair


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
