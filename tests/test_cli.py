"""Every entry point reports a user's mistake as one ``Error: ...`` line and exit status 1 (treedec/cli.py)."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import compose_config, local_config
from treedec.atomic import write_text_atomic
from treedec.cli import entry
from treedec.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def test_entry_turns_user_errors_into_one_line(monkeypatch, tmp_path):
    @entry
    def job(exc):
        raise exc if isinstance(exc, BaseException) else exc()

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    for exc in (ConfigError("bad value;\n  fix it"), FileNotFoundError("no such file"), ValueError("corrupt")):
        with pytest.raises(SystemExit) as e:
            job(exc)
        assert e.value.code == f"Error: {' '.join(str(exc).split())}"  # a str code: printed on stderr, exit status 1
    with pytest.raises(SystemExit, match=r"^Error: draft\.path is required: pass draft\.path=DIR"):  # item 17
        job(lambda: OmegaConf.create({"draft": {"path": "???"}}).draft.path)  # a ??? read without the schema check
    bad = tmp_path / "tree.yaml"
    bad.write_text("choices: [[0], [1]\n")

    def load():
        with bad.open() as f:
            return __import__("yaml").safe_load(f)

    with pytest.raises(SystemExit, match=rf"^Error: {re.escape(str(bad))} line 1: not valid YAML \(while parsing a "
                                         r"flow sequence; .*\); close the list with \]"):  # issue 46 item 1, any file
        job(load)
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


def test_readme_results_commands_compose_validate_and_name_shipped_heads():
    """The README's "Results" bench commands run as written: each composes and validates as a bench config, and each
    head of its bench.draft_heads is a shipped draft config whose bundled head is in the package."""
    import shlex

    from treedec.config import validate
    from treedec.heads.config import BUNDLED_DRAFTS
    from treedec.models.paths import CONF

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Results"):]
    section = section[:section.index("\n## ", 4)]
    block = section[section.index("```bash"):section.index("```", section.index("```bash") + 7)]
    lines = block.replace("\\\n", " ").splitlines()
    commands = [c for c in lines if c.startswith("python -m treedec.bench")]
    assert len(commands) >= 1
    for ab in [c for c in lines if c.startswith("python scripts/ab.py")]:  # each method spec names a policy
        import treedec.tree.policies as P
        from scripts.ab import policy, policy_knobs

        args = shlex.split(ab.split("  #")[0])[2:]
        specs = [a for prev, a in zip([""] + args, args)
                 if not a.startswith("--") and not a.isdigit() and prev != "--head"]  # (--head NAME=DIR: a value)
        for spec in specs:
            kind, _, arg = policy_knobs(spec.removesuffix("!"))[0].partition("+")[0].partition("@")[0].partition(":")
            assert kind == "vanilla" or policy(kind, arg, P) is not None, spec
    heads = set()
    for command in commands:
        args = shlex.split(command.split("  #")[0])[3:]
        cfg = compose_config("bench", args)
        validate(cfg, "bench")
        heads |= set(cfg.bench.draft_heads or [])
    assert {"tiny_code", "tiny_code_eagle3", "tiny_code_parallel", "tiny_code_dflash"} <= heads
    for head in heads:
        path = OmegaConf.load(CONF / "draft" / f"{head}.yaml").path
        assert (BUNDLED_DRAFTS[path] / "draft.safetensors").is_file(), head


@pytest.mark.parametrize("entry, arg, new", [
    ("train", "target=/models/x", "model.path"), ("train", "+target_dtype=float32", "model.dtype"),
    ("train", "draft=eagle3", "draft_arch"), ("generate", "kernel.backend=sdpa", "model.attn_backend"),
    ("export_head", "head=/heads/x", "draft.path"),
])
def test_renamed_keys_fail_naming_the_new_key(entry, arg, new):
    from treedec.cli import refuse_renamed

    with pytest.raises(SystemExit, match=rf"^Error: {arg.lstrip('+').split('=')[0].split('.')[0]}.* is now {new}"):
        refuse_renamed(entry, ["max_new_tokens=4", arg])
    current = ["draft=path", "draft_arch=eagle3", "kernel=sdpa", "hparams_search=optuna_tree", "experiment=tree_sweep"]
    refuse_renamed(entry, current if entry == "generate" else ["model.path=/x", "draft_arch=eagle3", "hydra.run.dir=x"])
    # the new names pass (experiment= is a real group again, conf/experiment/, no longer hparams_search's old name)


def test_a_run_dir_below_a_file_is_refused_before_hydra_makes_it(a_file):
    """Item 18d: Hydra makes ``hydra.run.dir`` (with a traceback) before any task code runs, so the command line is
    checked first, as for renamed keys."""
    from treedec.cli import refuse_renamed

    for key in ("hydra.run.dir", "hydra.sweep.dir"):
        with pytest.raises(SystemExit, match=rf"^Error: {key}='{re.escape(str(a_file))}/run' lies below "
                                             rf"{re.escape(str(a_file))}, which is a file; pass a path outside it$"):
            refuse_renamed("train", ["max_steps=4", f"{key}={a_file}/run"])
    with pytest.raises(SystemExit, match=r"is a file; pass a directory"):
        refuse_renamed("generate", [f"hydra.run.dir={a_file}"])
    refuse_renamed("generate", [f"hydra.run.dir={a_file.parent}/run", "hydra.run.dir=${oc.env:HOME}/x"])  # fine


# ------------------------------------------------------------------ the contract, once per entry point, end to end
@pytest.mark.slow
@pytest.mark.parametrize("module, args, needle", [
    ("treedec.generate", ["model.path=/nonexistent/model"], "Error: no model directory at '/nonexistent/model'"),
    ("treedec.train", ["target=/models/x"], "Error: target is now model.path"),  # refused before Hydra starts
    ("treedec.pretrain", ["paths.run_dir={file}"], "Error: paths.run_dir='{file}' is a file; pass a directory"),
    ("treedec.calibrate", ["dp.max_budget=1"], "Error: dp.max_budget=1: must be >= 2"),
    ("treedec.regenerate", ["input={file}", "out_dir={file}/sub"], "Error: out_dir='{file}/sub' lies below {file}"),
    ("treedec.export_head", ["format=eagle3", "out={tmp}/x"],
     "Error: draft.path=tiny-code-eagle is kind 'eagle', so it exports as format=eagle (not eagle3)"),
    ("treedec.bench", ["+bench.max_new_token=999"],
     "Error: invalid bench config: unknown key bench.max_new_token; "
     "Did you mean bench.max_new_tokens?"),
    ("treedec.generate", ["--config-dir={tmp}/conf"],  # issue 46 items 1 and 12: before the task, while composing
     "Error: {tmp}/conf/local/default.yaml line 2: not valid YAML (while parsing a flow sequence;"),
], ids=["generate", "train", "pretrain", "calibrate", "regenerate", "export_head", "bench", "generate-compose"])
def test_every_entry_point_prints_one_error_line(module, args, needle, a_file, tmp_path):
    """The real command: a user's mistake is exit status 1, the last stderr line ``Error: ...``, no traceback, and
    nothing written. The messages themselves are checked in-process (tests/test_user_mistakes.py and each entry
    point's own tests)."""
    fill = {"file": a_file, "tmp": tmp_path}
    local_config("# @package _global_\nmodel: {device: [cpu}\n")(None, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run([sys.executable, "-m", module, *[a.format(**fill) for a in args],
                           f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(needle.format(**fill)), done.stderr[-2000:]
    assert not (tmp_path / "run" / "metrics.json").exists() and not (tmp_path / "x").exists()


RAISING_TEMPLATE = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn comes first') }}{% endif %}"


@pytest.mark.parametrize("render, fix", [
    (lambda tok: __import__("treedec.data.chat", fromlist=["x"]).chat_prompt_ids(tok, "def f(x):", "pass chat=false"),
     "pass chat=false"),  # generate / calibrate / bench with chat=true
    (lambda tok: __import__("treedec.data.chat", fromlist=["x"]).ChatRenderer(tok, RAISING_TEMPLATE).render(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True), "set chat_template=fallback"),  # regenerate
], ids=["18e-prompt", "18e-renderer"])
def test_a_chat_template_that_raises_is_one_error_line(render, fix, monkeypatch):
    """Item 18e: the template's own raise_exception (or any error in it) names the template and the fix."""
    from treedec.models.tokenizer import load_tokenizer

    tok = load_tokenizer("tiny-code")
    tok.chat_template = RAISING_TEMPLATE
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as e:
        entry(render)(tok)
    assert re.fullmatch(r"Error: the (tokenizer's|custom) chat template failed to render \(TemplateError: a system turn "
                        rf"comes first\); fix the template, or {fix}.*", str(e.value.code)), e.value.code


class FullDisk:
    """``os.fdopen`` of a disk with no room: the first write fails with EFBIG (the fd is closed on exit)."""

    def __init__(self, fd, *args, **kwargs):
        self.fd = fd

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        os.close(self.fd)

    def write(self, text):
        import errno

        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))


def export_on_a_full_disk(path: Path) -> None:
    import errno

    from treedec.atomic import atomic_dir

    def save(tmp: Path) -> None:
        (tmp / "draft.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    atomic_dir(path, save)


@pytest.mark.parametrize("name, write", [
    ("metrics.json", lambda path: write_text_atomic(path, "{\"new\": 1}\n")),  # generate, calibrate, bench
    ("metrics.json", lambda path: __import__("treedec.atomic", fromlist=["x"]).write_json(path, {"new": 1})),
    ("export", export_on_a_full_disk),  # train / pretrain's exported head or model
], ids=["18f-write_text_atomic", "18f-train-metrics", "18f-export"])
def test_a_full_disk_is_one_error_line_and_keeps_what_was_there(name, write, tmp_path, monkeypatch):
    """Item 18f: EFBIG / ENOSPC while writing an output: one line saying the disk is full, naming the output and
    what was kept; the old file (or directory) is as it was and no temp file is left."""
    path = tmp_path / name
    if name == "export":
        path.mkdir()
        (path / "draft.safetensors").write_bytes(b"old")
    else:
        path.write_text("{\"old\": 1}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    monkeypatch.setattr(os, "fdopen", FullDisk)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as e:
        entry(write)(path)
    assert re.fullmatch(rf"Error: the disk is full writing {re.escape(str(path))} \((File too large|No space left on "
                        r"device)\): .*no file was left half-written and the files already there \(results, "
                        r"checkpoints\) are kept; free some space .*", str(e.value.code)), e.value.code
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temp file left
    assert (path / "draft.safetensors").read_bytes() == b"old" if name == "export" else path.read_text() == "{\"old\": 1}\n"
