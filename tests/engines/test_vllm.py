"""Every export format, served by vLLM (its CPU build) on the bundled target: vLLM's greedy tokens equal treedec's
vanilla tokens, and its per-prompt acceptance equals treedec's chain of the same depth with the same head, since
both follow the greedy chain rule (fp32, so that no near-tie can flip a token).

vLLM is an optional extra (``make vllm``). Without it these tests skip, except where ``TREEDEC_REQUIRE_VLLM=1``
(CI installs the extra and sets it), where a missing vLLM fails them: a broken install never passes as a skip.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from treedec.engines.vllm import EngineRun, run_vllm, vllm_available

pytestmark = pytest.mark.slow
K, NEW = 5, 48
HEADS = {"eagle": "tiny-code-eagle", "eagle3": "tiny-code-eagle3", "peagle": "tiny-code-parallel"}  # format -> head


@pytest.fixture(scope="module")
def vllm():
    if not vllm_available():
        if os.environ.get("TREEDEC_REQUIRE_VLLM") == "1":
            pytest.fail("TREEDEC_REQUIRE_VLLM=1 but vLLM is not installed: make vllm")
        pytest.skip("vLLM is not installed (make vllm); CI installs it and sets TREEDEC_REQUIRE_VLLM=1")


@pytest.fixture(scope="module")
def served(vllm, tmp_path_factory):
    """(prompts, vLLM's outputs by run, the export directories by format): one worker process for every engine."""
    import warnings

    from treedec import load_head, load_model, load_tokenizer
    from treedec.data.prompts import load_prompt_set
    from treedec.heads.export import export_head
    from treedec.models.paths import resolve_path

    tmp = tmp_path_factory.mktemp("exports")
    target = load_model("tiny-code", dtype=torch.float32)
    dirs = {}
    for fmt, name in HEADS.items():
        head = load_head(name, dtype=None, quantize=None)
        if fmt == "peagle":
            head.bind(target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the EAGLE-1/2 layout has no draft vocabulary: said elsewhere)
            dirs[fmt] = export_head(head, tmp / fmt, fmt)
    tok = load_tokenizer("tiny-code")
    prompts = [tok.encode(p.text) for p in load_prompt_set("third_party", 4, 64, tok, seed=0, hint="")]
    runs = [EngineRun("vanilla")] + [EngineRun(fmt, str(d), fmt, K) for fmt, d in dirs.items()]
    return prompts, run_vllm(resolve_path("tiny-code"), prompts, NEW, runs), dirs, target


def test_every_export_is_served_by_vllm_as_treedec_decodes_it(served):
    from treedec import ChainPolicy, SpeculativeDecoder, VanillaDecoder, load_head

    prompts, vllm, dirs, target = served
    vanilla = [list(VanillaDecoder(target, eos_ids=[]).generate([p], NEW).tokens[0]) for p in prompts]
    assert vllm["vanilla"].tokens == vanilla
    wrong = []
    for fmt, d in dirs.items():
        head = load_head(d, target=target, dtype=torch.float32, quantize=None)
        ours = [SpeculativeDecoder(target, head, ChainPolicy(K), eos_ids=[]).generate([p], NEW) for p in prompts]
        theirs = vllm[fmt]
        if theirs.tokens != vanilla:
            wrong.append(f"{fmt}: vLLM's tokens differ from vanilla's")
        mine = [{int(k): n for k, n in o.stats.accepted.items()} for o in ours]
        if theirs.accepted != mine:
            wrong.append(f"{fmt}: vLLM accepted {theirs.accepted}, treedec's chain {K} {mine}")
        assert theirs.acceptance_length > 2.0, f"{fmt}: the export drafts nothing useful in vLLM"
    assert not wrong, "; ".join(wrong)


def test_bench_runs_vllm_beside_treedec(vllm, tmp_path):
    """bench.peers=[vllm, vllm_eagle3]: vLLM's rows sit beside treedec's, token for token vanilla's output in fp32,
    and the EAGLE-3 peer's τ is treedec's chain of the same depth with the same head."""
    from tests.helpers import compose_config
    from treedec.bench import harness

    cfg = compose_config("bench", ["model.dtype=float32", "draft=tiny_code_eagle3", "bench.methods=[vanilla,chain]",
                                   "bench.peers=[vllm,vllm_eagle3,vllm_peagle]", f"bench.trees.chain.depth={K}",
                                   f"bench.vllm_tokens={K}", "bench.n_prompts=2", "bench.max_new_tokens=24",
                                   "bench.repeats=1", "bench.warmup=0", "bench.plots=false", "bench.vanilla_fp32=false",
                                   f"paths.run_dir={tmp_path}"])
    rows = harness.run(cfg)["methods"]
    assert {"vllm", "vllm_eagle3"} <= rows.keys()
    assert rows["vllm"]["identical_to_vanilla"] and rows["vllm_eagle3"]["identical_to_vanilla"]
    assert rows["vllm_eagle3"]["tau"] == pytest.approx(rows["chain"]["tau"])
    assert rows["vllm"]["tokens_per_s"] > 0 and rows["vllm_eagle3"]["tau"] > 2.0
    skipped = json.loads((tmp_path / "metrics.json").read_text())["skipped"]
    assert "no head of the bench exports as format=peagle" in skipped["vllm_peagle"]  # (the bench's head: EAGLE-3)


def test_regenerate_engine_vllm_writes_the_lightning_engines_shards_and_resumes(vllm, tmp_path):
    """engine=vllm: 8 records, greedy fp32, shards byte for byte engine=lightning's; a shard lost to a kill is
    decoded again by the same command (and only it); the other engine on its out_dir is refused."""
    from tests.helpers import compose_config
    from treedec.regenerate import run

    records = tmp_path / "r.jsonl"
    from treedec import load_tokenizer
    from treedec.data.prompts import load_prompt_set

    tok = load_tokenizer("tiny-code")
    texts = [p.text for p in load_prompt_set("third_party", 8, 48, tok, seed=3, hint="")]
    records.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))

    def regen(engine, out):
        return run(compose_config("regenerate", [f"input={records}", "model.dtype=float32", f"engine={engine}",
                                                 "max_new_tokens=40", "batch_size=4", "shard_size=4", "progress=false",
                                                 f"paths.run_dir={out}"]))

    regen("lightning", tmp_path / "l")
    regen("vllm", tmp_path / "v")
    shards = lambda d: {p.name: p.read_bytes() for p in sorted((d / "shards").glob("part-*.jsonl"))}
    assert len(shards(tmp_path / "l")) == 2 and shards(tmp_path / "v") == shards(tmp_path / "l")
    for f in (tmp_path / "v" / "shards").glob("part-00001.*"):  # killed before shard 1 was written
        f.unlink()
    again = regen("vllm", tmp_path / "v")
    assert again["this_run"]["shards"] == 1 and shards(tmp_path / "v") == shards(tmp_path / "l")
    with pytest.raises(ValueError, match="differs in: engine"):
        regen("lightning", tmp_path / "v")
