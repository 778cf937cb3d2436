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
    """No circle: the refusal of a one-pass head names no other format to try, only its treedec directory's use,
    from its config before its weights load; export_head itself says the same of a loaded head."""
    from omegaconf import OmegaConf

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
    assert f"draft.path={head_dir} is a one-pass (P-EAGLE, kind parallel) head" in msg
    assert "cannot export one to an engine layout yet" in msg and f"draft=path draft.path={head_dir})" in msg
    assert "format=parallel" not in msg and "\n" not in msg
    from tests.helpers import parallel_pair

    with pytest.raises(ValueError, match="the head is a one-pass .* cannot export one") as err:
        export_head(parallel_pair()[1], tmp_path / "out", fmt)
    assert "format=parallel" not in str(err.value)
    assert not (tmp_path / "out").exists()
