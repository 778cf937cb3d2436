"""``python -m treedec.export_head``: a treedec head written in a public layout reads back as the same head."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import randomize_, tiny_model
from treedec.heads import DraftConfig, build_head, load_head
from treedec.heads.export import export_head

ROOT = Path(__file__).resolve().parents[1]


def make_head(target, seed, **kw):
    """A random head, fused as ``load_head`` fuses it (so that logits compare bit for bit)."""
    torch.manual_seed(seed)
    head = randomize_(build_head(DraftConfig.for_target(target.config, **kw)), seed).eval()
    head.layer.fuse()
    return head.bind(target)


@torch.inference_mode()
def head_logits(head, seed, T=9):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, head.config.vocab_size, (1, T), generator=g)
    feats = torch.randn(1, T, head.config.hidden_size * len(head.config.feature_layers), generator=g)
    cache = head.new_cache(1, T)
    feats = head.project(feats) if head.config.kind == "eagle3" else feats  # EAGLE-3: fc(l, m, h) first
    return head.logits(head(tokens, feats, cache, torch.arange(T)[None]))


def decode(target, head, prompt):
    from treedec.decoding.speculative import SpeculativeDecoder
    from treedec.tree.policies import DynamicPolicy

    out = SpeculativeDecoder(target, head, DynamicPolicy(total_tokens=16, depth=4, top_k=4), eos_ids=[]).generate(prompt, 40)
    return out.tokens[0], out.stats.accepted


@pytest.mark.parametrize("variant", ["plain", "no_fc_bias", "qkv_bias"])
def test_eagle_round_trip(variant, tmp_path):
    target = tiny_model(seed=1)
    head = make_head(target, 2, fc_bias=variant != "no_fc_bias", qkv_bias=variant == "qkv_bias")
    if variant == "qkv_bias":  # vLLM would read "bias" as attention biases this head already has its own of
        with pytest.warns(UserWarning, match="vLLM cannot hold both"):
            out = export_head(head, tmp_path / "out", "eagle")
    else:
        out = export_head(head, tmp_path / "out", "eagle")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM" if variant == "qkv_bias" else "LlamaForCausalLM"]
    assert cfg["bias"] == (variant != "no_fc_bias") and cfg["num_hidden_layers"] == 1
    again = load_head(out, target=target)
    assert again.config.kind == "eagle" and (again.fc.bias is None) == (variant == "no_fc_bias")
    torch.testing.assert_close(head_logits(again, 3), head_logits(head, 3), atol=0, rtol=0)
    prompt = list(range(3, 14))
    assert decode(target, again, prompt) == decode(target, head, prompt)  # tokens and per-step acceptance


def test_eagle_export_keys_are_the_published_ones(tmp_path):
    from safetensors import safe_open

    head = make_head(tiny_model(seed=1), 4)
    out = export_head(head, tmp_path / "out", "eagle")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "fc.weight" in keys and "fc.bias" in keys and "layers.0.self_attn.q_proj.weight" in keys
    assert all(k.startswith(("fc.", "layers.0.")) for k in keys) and not any("qkv_proj" in k for k in keys)
    import transformers
    assert transformers.AutoConfig.from_pretrained(out).num_hidden_layers == 1


def test_restricted_vocab_eagle_head_warns(tmp_path):
    target = tiny_model(seed=1)
    head = make_head(target, 5).restrict_vocab(torch.arange(0, 97, 2))
    with pytest.warns(UserWarning, match="no draft vocabulary"):
        out = export_head(head, tmp_path / "out", "eagle")
    again = load_head(out, target=target)
    assert again.config.draft_vocab_size == 0
    prompt = list(range(5, 12))
    assert decode(target, again, prompt)[0] == decode(target, head, prompt)[0]  # lossless either way


@pytest.mark.parametrize("nbr", [False, True])
def test_eagle3_round_trip(nbr, tmp_path):
    target = tiny_model(seed=6, num_hidden_layers=4)
    head = make_head(target, 7, kind="eagle3", feature_layers=[0, 1, 3], draft_vocab_size=40, rope_theta=5e5,
                     norm_before_residual=nbr)
    head.restrict_vocab(torch.randperm(97, generator=torch.Generator().manual_seed(8))[:40])
    out = export_head(head, tmp_path / "out", "eagle3")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 40
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3] and cfg["rope_theta"] == 5e5
    again = load_head(out, target=target)
    assert again.config.feature_layers == [0, 1, 3] and torch.equal(again.vocab_ids, head.vocab_ids)
    assert cfg["norm_before_residual"] == nbr == again.config.norm_before_residual
    torch.testing.assert_close(head_logits(again, 9), head_logits(head, 9), atol=0, rtol=0)
    prompt = list(range(20, 33))
    assert decode(target, again, prompt) == decode(target, head, prompt)


def test_format_must_match_the_kind(tmp_path):
    head = make_head(tiny_model(seed=1), 2)
    with pytest.raises(ValueError, match="kind 'eagle', so it exports as format=eagle"):
        export_head(head, tmp_path / "out", "eagle3")
    with pytest.raises(ValueError, match="q/k norms"):
        export_head(make_head(tiny_model(seed=1), 2, qk_norm=True), tmp_path / "out", "eagle")
    assert not (tmp_path / "out").exists()


def test_out_directory_rules(tmp_path):
    head = make_head(tiny_model(seed=1), 2)
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not empty, and export_head did not make it"):
        export_head(head, tmp_path / "theirs", "eagle")
    assert [p.name for p in (tmp_path / "theirs").iterdir()] == ["notes.txt"]
    out = export_head(head, tmp_path / "mine", "eagle")
    export_head(head, out, "eagle", dtype=torch.bfloat16)  # its own earlier export: replaced whole
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "theirs"]  # no temp dirs left


@pytest.mark.slow
def test_cli_exports(tmp_path):
    out = tmp_path / "exported"
    run = lambda *a: subprocess.run([sys.executable, "-m", "treedec.export_head", *a,
                                     f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True,
                                    timeout=180, cwd=ROOT)
    done = run("draft.path=tiny-code-eagle", "format=eagle", f"out={out}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert {"config.json", "model.safetensors"} <= {p.name for p in out.iterdir()}
    bundled = load_head("tiny-code-eagle")
    again = load_head(out)
    for k, v in again.state_dict().items():
        if k != "vocab_ids":
            torch.testing.assert_close(v, bundled.state_dict()[k], atol=0, rtol=0)


def test_config_is_checked_before_loading():
    from omegaconf import OmegaConf

    from treedec.config import ConfigError, validate

    ok = dict(draft={"_target_": "treedec.heads.load_head", "path": "tiny-code-eagle"}, format="eagle",
              out="x", dtype=None)
    validate(OmegaConf.create(ok), "export_head")
    for bad, needle in ((dict(format="medusa"), "format='medusa'"), (dict(dtype="int8"), "invalid dtype"),
                        (dict(outt="y"), "outt")):
        with pytest.raises(ConfigError, match=needle):
            validate(OmegaConf.create({**ok, **bad}), "export_head")


def test_a_second_export_keeps_what_the_user_added(tmp_path, caplog):
    import logging

    target = tiny_model(seed=1)
    out = export_head(make_head(target, 2), tmp_path / "d", "eagle")
    (out / "README.md").write_text("# my head\n")
    (out / "tokenizer.json").write_text("{}")
    with caplog.at_level(logging.INFO, logger="treedec.export_head"):
        export_head(make_head(target, 3), out, "eagle", dtype=torch.bfloat16)
    assert (out / "README.md").read_text() == "# my head\n" and (out / "tokenizer.json").read_text() == "{}"
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    again = load_head(out, target=target)
    assert again.dtype == torch.bfloat16
    torch.testing.assert_close(again.fc.weight.float(), make_head(target, 3).fc.weight.bfloat16().float())
    assert "kept README.md, tokenizer.json" in caplog.text and "replaced model.safetensors, config.json" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # no work directory left


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_work_directories_of_killed_exports_are_cleaned(tmp_path):
    import os
    import socket
    import time

    from treedec.heads.export import OWNER, WORK

    host = socket.gethostname()

    def work(suffix, owner=None, files=("config.json",), age_s=0):
        d = tmp_path / f".out{WORK}{suffix}"
        d.mkdir()
        for f in files:
            (d / f).write_text("x")
        if owner is not None:
            (d / OWNER).write_text(owner)
        os.utime(d, (time.time() - age_s,) * 2)
        return d

    stale = [work("dead0001", f"{host} {_dead_pid()}", ("config.json", "model.safetensors")),
             work("old00001", "elsewhere 1", age_s=2 * 86400), work("noowner1", None, age_s=2 * 86400)]
    keep = [work("live0001", f"{host} {os.getpid()}"),  # an export running now
            work("other001", f"elsewhere {_dead_pid()}"),  # another host's, recent: maybe running
            work("noowner2", None),  # recent, owner not (yet) written
            work("userfil1", f"{host} {_dead_pid()}", ("config.json", "notes.txt")),  # holds a file of someone else
            work("short", f"{host} {_dead_pid()}"),  # not the tool's name
            tmp_path / ".out.abcd1234", tmp_path / f".other{WORK}abcd1234"]
    for d in keep[-2:]:
        d.mkdir()
    export_head(make_head(tiny_model(seed=1), 2), tmp_path / "out", "eagle")
    assert not any(d.exists() for d in stale)
    assert all(d.is_dir() for d in keep)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the EAGLE-1/2 layout has no draft vocabulary")
def test_a_killed_export_is_cleaned_up_by_the_next(tmp_path):
    code = ("import os, sys, warnings; import treedec.heads.export as e; "
            "from treedec.heads import load_head; real = e.save_file; warnings.simplefilter('ignore'); "
            "e.save_file = lambda *a, **k: (real(*a, **k), os._exit(9)); "  # killed once the weights are written
            "e.export_head(load_head('tiny-code-eagle'), sys.argv[1], 'eagle')")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], cwd=ROOT, timeout=180)
    assert done.returncode == 9
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".out.treedec-export-tmp.")  # what a kill leaves
    export_head(load_head("tiny-code-eagle"), tmp_path / "out", "eagle")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.filterwarnings("ignore:the EAGLE-1/2 layout has no draft vocabulary")
def test_export_records_the_target_fingerprint_and_loading_warns_on_another(tmp_path):
    import warnings

    from treedec.heads import target_fingerprint

    target, other = tiny_model(seed=1), tiny_model(seed=5)  # same shape, other weights
    out = export_head(make_head(target, 2), tmp_path / "out", "eagle")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["treedec"]["target_fingerprint"] == target_fingerprint(target)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_head(out, target=target)  # its own target: silent
    with pytest.warns(UserWarning, match=rf"fingerprint {target_fingerprint(target)}.*different target.*"
                                         rf"fingerprint {target_fingerprint(other)}"):
        load_head(out, target=other)
    unbound = load_head("tiny-code-eagle")  # not bound: the fingerprint its draft_config.json recorded
    out = export_head(unbound, tmp_path / "bundled", "eagle")
    assert json.loads((out / "config.json").read_text())["treedec"] == {
        "target": "tiny-code", "target_fingerprint": unbound.config.target_fingerprint}


@pytest.mark.parametrize("fmt", ["eagle", "eagle3"])
def test_a_one_pass_head_is_refused_naming_what_works(fmt, tmp_path):
    """No circle: a one-pass head asked for another layout is refused naming format=peagle, which works, from its
    config before its weights load; export_head itself says the same of a loaded head."""
    from omegaconf import OmegaConf

    from tests.helpers import parallel_pair
    from treedec.export_head import run
    from treedec.heads.config import BUNDLED_DRAFTS, DRAFT_CONFIG

    head_dir = tmp_path / "one-pass"  # its config alone: refused before any weights would be read
    head_dir.mkdir()
    (head_dir / DRAFT_CONFIG).write_bytes((BUNDLED_DRAFTS["tiny-code-parallel"] / DRAFT_CONFIG).read_bytes())
    cfg = OmegaConf.create(dict(draft={"_target_": "treedec.heads.load_head", "path": str(head_dir)},
                                format=fmt, out=str(tmp_path / "out"), dtype=None))
    with pytest.raises(ValueError) as err:
        run(cfg)
    msg = str(err.value)
    assert f"draft.path={head_dir} is kind 'parallel', so it exports as format=peagle (not {fmt})" in msg
    assert "\n" not in msg
    with pytest.raises(ValueError, match="kind 'parallel', so it exports as format=peagle"):
        export_head(parallel_pair()[1], tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_a_dflash_head_is_refused_naming_its_own_directory(tmp_path):
    from tests.helpers import dflash_pair

    for fmt in ("eagle", "eagle3", "peagle"):
        with pytest.raises(ValueError, match="kind 'dflash', which no engine layout treedec writes holds .*q/k norms"):
            export_head(dflash_pair()[1], tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists()


def test_eagle_export_is_exact_as_vllm_reads_it(tmp_path):
    """vLLM reads "bias": true as q/k/v and o_proj biases and gives fc none: the export folds fc's bias into those,
    so a head built as vLLM builds it from the file (fc without bias, biased attention) drafts what the head does."""
    from safetensors.torch import load_file

    target = tiny_model(seed=1)
    head = make_head(target, 2)
    out = export_head(head, tmp_path / "out", "eagle")
    sd = load_file(str(out / "model.safetensors"))
    as_vllm = build_head(DraftConfig.for_target(target.config, fc_bias=False, qkv_bias=True, o_bias=True)).eval()
    state = {"fc.weight": sd["fc.weight"], **{"layer." + k[len("layers.0."):]: v for k, v in sd.items()
                                              if k.startswith("layers.0.")}}
    as_vllm.load_state_dict(state)
    as_vllm.layer.fuse()
    as_vllm.bind(target)
    torch.testing.assert_close(head_logits(as_vllm, 3), head_logits(head, 3), atol=1e-5, rtol=1e-5)
    without = make_head(target, 2, fc_bias=False)  # no fc bias: no attention biases either ("bias": false)
    sd = load_file(str(export_head(without, tmp_path / "plain", "eagle") / "model.safetensors"))
    assert not any(k.endswith(".bias") for k in sd)


def test_a_tampered_fold_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    target = tiny_model(seed=1)
    out = export_head(make_head(target, 2), tmp_path / "out", "eagle")
    sd = load_file(str(out / "model.safetensors"))
    sd["layers.0.self_attn.o_proj.bias"] = sd["layers.0.self_attn.o_proj.bias"] + 1.0
    save_file(sd, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="o_proj.bias is not fc.bias folded into the layer"):
        load_head(out, target=target)


@pytest.mark.parametrize("layers", [1, 2])
def test_peagle_round_trip(layers, tmp_path):
    """format=peagle (vLLM's parallel drafting): the mask feature goes back before fc, the mask embedding into the
    target's table at its end-of-text row; the treedec reader (checked against vLLM's forward in
    tests/heads/test_head_formats.py) gives back the head's marginals."""
    from safetensors.torch import load_file

    from tests.heads.test_head_formats import peagle_marginals
    from tests.helpers import parallel_pair

    target, head = parallel_pair(seed=3, K=4, sharpen=3.0)
    if layers > 1:
        from treedec.heads.parallel import ParallelHead
        torch.manual_seed(4)
        deep = randomize_(build_head(DraftConfig.for_target(target.config, kind="parallel", block_size=4,
                                                            draft_layers=layers, draft_vocab_size=40)), 4).eval()
        deep.restrict_vocab(head.vocab_ids)
        head = deep.bind(target)
        assert isinstance(head, ParallelHead)
    target.config.eos_token_id = 7
    out = export_head(head, tmp_path / "out", "peagle")
    cfg = json.loads((out / "config.json").read_text())
    sd = load_file(str(out / "model.safetensors"))
    assert cfg["mask_token_id"] == 7 and cfg["num_speculative_tokens"] == 4 and cfg["num_hidden_layers"] == layers
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and "d2t" in sd
    assert sd["mask_hidden"].shape == (1, 1, 3 * target.config.hidden_size)
    torch.testing.assert_close(sd["fc.weight"] @ sd["mask_hidden"].reshape(-1), head.mask_hidden.float(),
                               atol=1e-5, rtol=1e-5)
    table = target.model.embed_tokens.weight
    assert torch.equal(sd["embed_tokens.weight"][7], head.mask_embed.float())
    assert torch.equal(sd["embed_tokens.weight"][:7], table[:7].float())
    assert (f"layers.{layers - 1}.mlp.down_proj.weight" in sd) == (layers > 1)
    again = load_head(out, target=target)
    assert again.config.kind == "parallel" and again.config.draft_layers == layers
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, target.config.vocab_size, (1, 9), generator=g)
    lmh = torch.randn(1, 9, 3 * target.config.hidden_size, generator=g)
    torch.testing.assert_close(peagle_marginals(again, tokens, lmh, 4), peagle_marginals(head, tokens, lmh, 4),
                               atol=1e-4, rtol=1e-4)


def test_a_peagle_export_needs_its_target(tmp_path):
    from tests.helpers import parallel_pair

    head = parallel_pair()[1]
    head._target = ()
    with pytest.raises(ValueError, match="carries the target's embedding table: bind the head"):
        export_head(head, tmp_path / "out", "peagle")
