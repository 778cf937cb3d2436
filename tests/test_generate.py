"""`python -m treedec.generate` end to end on a tiny random model (in-process and as a subprocess)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import compose_config, generate_overrides


@pytest.mark.parametrize("tree", ["dynamic", "static", "chain"])
def test_generate_matches_vanilla_and_writes_metrics(stack, tmp_path, tree, capsys):
    from treedec.generate import run

    cfg = compose_config("generate", generate_overrides(stack, tmp_path, f"tree={tree}", "compare=true"))
    m = run(cfg)
    assert m["identical_to_vanilla"] is True and m["new_tokens"] > 0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["tau"] >= 1.0 and saved["config"]["tree"]["_target_"].endswith("Policy")
    out = capsys.readouterr().out
    assert "def add(a, b):" in out and "tau" in out and "speedup" in out


@pytest.mark.slow
def test_cli_subprocess(stack, tmp_path):
    cmd = [sys.executable, "-m", "treedec.generate", *generate_overrides(stack, tmp_path)[:-2],
           f"hydra.run.dir={tmp_path}", "prompt='class Thing:'", "sampling=sample"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "metrics.json").is_file() and "tok/s" in done.stdout


def test_zero_new_tokens_with_compare_writes_metrics(stack, tmp_path, capsys):
    """max_new_tokens=0 compare=true: nothing to time, so no speedup; the summary says so and metrics.json exists."""
    from treedec.generate import run

    cfg = compose_config("generate", generate_overrides(stack, tmp_path, "max_new_tokens=0", "compare=true"))
    m = run(cfg)
    assert m["new_tokens"] == 0 and m["speedup"] is None and m["identical_to_vanilla"] is True
    assert json.loads((tmp_path / "metrics.json").read_text())["speedup"] is None
    assert "0 tokens," in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("override,needle", [
    ("prompt_file={missing}", r"prompt_file='.*missing\.py': no such file"),
    ("prompt_file={dir}", r"prompt_file='.*' is a directory; pass the path of a text file"),
    ("prompt_file={binary}", r"prompt_file='.*blob\.bin' is not UTF-8 text"),
    ("num_threads=-1", r"num_threads=-1: must be >= 1"),
    ("max_new_tokens=-1", r"max_new_tokens=-1: must be >= 0"),
    ("+optimized_metric=tokens_per_sec", r"optimized_metric='tokens_per_sec' is not a numeric metric of generate; "
                                         r"choose one of tau, tokens_per_s"),
    ("+optimized_metric=speedup", r"optimized_metric='speedup' .*\(speedup needs compare=true\)"),
    ("+model.devcie=cpu", r"model\.devcie.*Did you mean model\.device\? Keys of model: path, dtype, device"),
    ("model.device=tpu", r"invalid model\.device: unknown device 'tpu'"),
    ("tree=dynamic|tree.total_tokens=1", r"invalid tree config: tree\.total_tokens=1 must be a whole number >= 2"),
])
def test_bad_options_fail_before_the_model_loads(tmp_path, override, needle):
    from treedec.config import ConfigError
    from treedec.generate import run

    (tmp_path / "blob.bin").write_bytes(bytes(range(256)))
    override = override.format(missing=tmp_path / "missing.py", dir=tmp_path, binary=tmp_path / "blob.bin")
    cfg = compose_config("generate", ["model.path=/nonexistent/model", f"paths.run_dir={tmp_path}",
                                      *override.split("|")])
    with pytest.raises((ConfigError, OSError), match=needle):  # not the model's FileNotFoundError: checked first
        run(cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default")
def test_hf_model_defaults_to_auto_device(stack, tmp_path):
    """model=hf used to default to device cuda and fail on a CPU machine; auto resolves to the CPU here."""
    from treedec.generate import run

    cfg = compose_config("generate", ["model=hf", *generate_overrides(stack, tmp_path, "max_new_tokens=2")])
    assert cfg.model.device == "auto"
    assert run(cfg)["new_tokens"] == 2


def test_objective_for_optuna():
    from treedec.generate import objective

    assert objective({"tau": 2}, "tau") == 2.0 and objective({"tau": 2}, None) is None
    assert objective({"speedup": None}, "speedup") != objective({"speedup": None}, "speedup")  # NaN: a failed trial


@pytest.mark.slow
def test_generate_compile_reports_compile_time_apart(stack, tmp_path):
    from treedec.generate import run

    cfg = compose_config("generate", generate_overrides(stack, tmp_path, "tree=chain", "compare=true", "compile=true",
                                                        "stream=false"))
    m = run(cfg)
    assert m["identical_to_vanilla"] is True  # fp32: compiled == eager == vanilla
    assert m["compile_s"]["speculative"] > 0 and m["compile_s"]["vanilla"] > 0
    assert json.loads((tmp_path / "metrics.json").read_text())["compile_s"] == m["compile_s"]
