"""Every entry point reports a user's mistake as one ``Error: ...`` line and exit status 1 (treedec/cli.py)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from treedec.cli import entry, write_text_atomic
from treedec.config_schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_entry_turns_user_errors_into_one_line(monkeypatch):
    @entry
    def job(exc):
        raise exc

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    for exc in (ConfigError("bad value;\n  fix it"), FileNotFoundError("no such file"), ValueError("corrupt")):
        with pytest.raises(SystemExit) as e:
            job(exc)
        assert e.value.code == f"Error: {' '.join(str(exc).split())}"  # a str code: printed on stderr, exit status 1
    with pytest.raises(TypeError):  # a bug keeps its traceback
        job(TypeError("unsupported format string passed to NoneType.__format__"))
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(ConfigError):
        job(ConfigError("shown with its traceback"))


def test_write_text_atomic_follows_the_umask_and_leaves_no_temp(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_text_atomic(tmp_path / "sub" / "metrics.json", "{}\n")
    finally:
        os.umask(old)
    assert path.read_text() == "{}\n" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [p.name for p in path.parent.iterdir()] == ["metrics.json"]


@pytest.mark.parametrize("module,args,needle", [
    ("treedec.generate", ["prompt_file={tmp}"], "Error: prompt_file='{tmp}' is a directory; pass the path of a text file"),
    ("treedec.generate", ["model.path=/nonexistent/model"], "Error: no model directory at '/nonexistent/model'"),
    ("treedec.calibrate", ["dp.max_budget=1"], "Error: dp.max_budget=1: must be >= 2"),
    ("treedec.bench", ["+bench.max_new_token=999"],
     "Error: invalid bench config at bench.max_new_token: Key 'max_new_token' not in 'BenchOptionsSchema'. "
     "Did you mean bench.max_new_tokens?"),
])
def test_entry_points_print_one_error_line(tmp_path, module, args, needle):
    args = [a.format(tmp=tmp_path) for a in args]
    cmd = [sys.executable, "-m", module, *args, f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr[-2000:]
    assert lines and lines[-1].startswith(needle.format(tmp=tmp_path)), done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "run" / "metrics.json").exists()


def test_readme_results_command_runs_the_shipped_learned_tree():
    """The README's "Results" bench command has no learned_path: bench's default must find the shipped tree."""
    import yaml

    from treedec.tree.policies import LearnedPolicy

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Results"):]
    section = section[:section.index("\n## ", 4)]
    assert "`python -m treedec.bench bench.num_threads=2`" in section and "learned" in section
    from treedec.models.paths import ASSETS, CONF

    conf = yaml.safe_load((CONF / "bench.yaml").read_text())
    assert conf["bench"]["learned_path"] == "auto" and "learned" in conf["bench"]["methods"]
    shipped = ASSETS / "tiny-code-eagle" / "learned_tree.yaml"
    assert LearnedPolicy(str(shipped)).max_size == 48  # the tree the README's table reports


@pytest.mark.parametrize("entry, arg, new", [
    ("train", "target=/models/x", "model.path"), ("train", "+target_dtype=float32", "model.dtype"),
    ("train", "draft=eagle3", "draft_arch"), ("generate", "kernel.backend=sdpa", "model.attn_backend"),
    ("generate", "+experiment=optuna_tree", "hparams_search"), ("export_head", "head=/heads/x", "draft.path"),
])
def test_renamed_keys_fail_naming_the_new_key(entry, arg, new):
    from treedec.cli import refuse_renamed

    with pytest.raises(SystemExit, match=rf"^Error: {arg.lstrip('+').split('=')[0].split('.')[0]}.* is now {new}"):
        refuse_renamed(entry, ["max_new_tokens=4", arg])
    refuse_renamed(entry, ["draft=path", "draft_arch=eagle3", "kernel=sdpa", "hparams_search=optuna_tree"] if entry
                   == "generate" else ["model.path=/x", "draft_arch=eagle3", "hydra.run.dir=x"])  # the new names pass


def test_renamed_key_on_the_command_line_is_one_error_line():
    done = subprocess.run([sys.executable, "-m", "treedec.train", "target=/models/x"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and done.stderr.strip().splitlines()[-1].startswith("Error: target is now model.path")
