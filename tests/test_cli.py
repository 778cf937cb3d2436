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

from treedec.atomic import write_text_atomic
from treedec.cli import entry
from treedec.config_schema import ConfigError

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

    from hydra import compose, initialize_config_dir

    from treedec.config_checks import validate
    from treedec.models.draft_config import BUNDLED_DRAFTS
    from treedec.models.paths import CONF

    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Results"):]
    section = section[:section.index("\n## ", 4)]
    block = section[section.index("```bash"):section.index("```", section.index("```bash") + 7)]
    commands = [c for c in block.replace("\\\n", " ").splitlines() if c.startswith("python -m treedec.bench")]
    assert len(commands) >= 2
    heads = set()
    for command in commands:
        args = shlex.split(command.split("  #")[0])[3:]
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="bench", overrides=args)
        validate(cfg, "bench")
        heads |= set(cfg.bench.draft_heads or [])
    assert {"tiny_code", "tiny_code_eagle3", "tiny_code_parallel"} <= heads
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
    ("treedec.export_head", ["format=eagle3", "out={tmp}/x"], "Error: the head is kind 'eagle'"),
    ("treedec.bench", ["+bench.max_new_token=999"],
     "Error: invalid bench config at bench.max_new_token: Key 'max_new_token' not in 'BenchOptionsSchema'. "
     "Did you mean bench.max_new_tokens?"),
    ("treedec.generate", ["--config-dir={tmp}/conf"],  # issue 46 items 1 and 12: before the task, while composing
     "Error: {tmp}/conf/local/default.yaml line 2: not valid YAML (while parsing a flow sequence;"),
], ids=["generate", "train", "pretrain", "calibrate", "regenerate", "export_head", "bench", "generate-compose"])
def test_every_entry_point_prints_one_error_line(module, args, needle, a_file, tmp_path):
    """The real command: a user's mistake is exit status 1, the last stderr line ``Error: ...``, no traceback, and
    nothing written. The messages themselves are checked in-process (test_user_mistakes_are_one_error_line and
    each entry point's own tests)."""
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


# ------------------------------------------------------------------ user mistakes: one line, before any work
def compose_cfg(name: str, overrides: list[str]):
    """A composed entry-point config with its hydra node (the choices name the group, as in a real run)."""
    from hydra import compose, initialize_config_dir

    from treedec.models.paths import CONF

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides, return_hydra_config=True)


def entry_module(name: str):
    import importlib

    return importlib.import_module("treedec.bench.__main__" if name == "bench" else f"treedec.{name}")


def entry_run(name: str):
    """The task body an entry point wraps in :func:`entry` (its ``run``)."""
    return entry_module(name).run


def run_entry_point(name: str, args: list[str], monkeypatch) -> None:
    """``python -m treedec.<name> <args>``, in-process: a config that Hydra cannot compose goes through the real
    command (:func:`treedec.cli.launch` around the entry's Hydra main, which stops before any task code); one that
    composes is handed to the entry's task body (its ``run`` under :func:`entry`), which must stop before any work."""
    from treedec.cli import launch

    searchpath = [f"hydra.searchpath=[file://{a.split('=', 1)[1]}]" for a in args if a.startswith("--config-dir=")]
    try:
        cfg = compose_cfg(name, [a for a in args if not a.startswith("--")] + searchpath)
    except Exception:
        monkeypatch.setattr(sys, "argv", [f"treedec.{name}", *args])
        launch(name, entry_module(name).main)
        raise AssertionError(f"python -m treedec.{name} {' '.join(args)} ran without an error") from None
    entry(entry_run(name))(cfg)


@pytest.fixture
def a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("not a directory\n")
    return path


def no_gpu(monkeypatch, tmp_path=None):
    from lightning.pytorch.accelerators import CUDAAccelerator, MPSAccelerator

    for acc in (CUDAAccelerator, MPSAccelerator):
        monkeypatch.setattr(acc, "is_available", staticmethod(lambda: False))


def stdin_of(data: bytes, cap: int | None = None):
    """A setup piping ``data`` to stdin (under a prompt-size cap of ``cap`` bytes)."""
    def setup(monkeypatch, tmp_path):
        import io

        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        if cap is not None:
            monkeypatch.setenv("TREEDEC_PROMPT_MAX_BYTES", str(cap))
    return setup


# the cases below, by issue 39's item numbers
MISTAKES = ["17-draft.path", "17-model.path", "17-no-model-dir", "17-tree.path", "17-data.path", "17-out", "18a-no-gpu",
            "18b-triton-on-cpu", "18d-run-dir-below-file", "18d-calibrate-out-below-file", "18d-calibrate-out-is-dir",
            "18d-export-out-below-file", "18d-regenerate-out-dir", "18d-export-dir", "18d-pretrain-run-dir-is-file",
            "10-dev-zero", "10-file-over-cap", "10-stdin-over-cap", "18c-stdin-not-utf8",
            # issue 46: a config Hydra cannot compose (item 1: a local config that is not YAML; item 12: the rest)
            "46.1-local-unclosed-list", "46.1-local-tab", "46.12-no-experiment", "46.12-bench-no-experiment",
            "46.12-experiment-of-bench", "46.12-train-experiment", "46.12-no-tree", "46.12-tree-key",
            "46.12-local-list", "46.12-local-key", "46.12-local-empty", "46.12-local-no-header", "46.12-unquoted",
            "46.12-pretrain-group", "46.12-regenerate-type", "46.12-export-key"]


def local_config(text: str):
    """A setup writing ``text`` as ``{tmp}/conf/local/default.yaml`` (passed as ``--config-dir={tmp}/conf``)."""
    def setup(monkeypatch, tmp_path):
        (tmp_path / "conf" / "local").mkdir(parents=True)
        (tmp_path / "conf" / "local" / "default.yaml").write_text(text)
    return setup


LOCAL = "--config-dir={tmp}/conf"


@pytest.mark.parametrize("name, overrides, setup, message", [
    # item 17: a key the chosen group leaves ??? (30 lines of MissingMandatoryValue before)
    ("generate", ["draft=path"], None, r"draft\.path is required with draft=path: pass draft\.path=DIR"),
    ("generate", ["model=hf"], None, r"model\.path is required with model=hf: pass model\.path=DIR"),
    ("generate", ["model.path=/nonexistent/model"], None, r"no model directory at '/nonexistent/model'"),
    ("generate", ["tree=learned"], None, r"tree\.path is required with tree=learned: pass tree\.path=FILE"),
    ("train", ["data=jsonl"], None, r"data\.path is required with data=jsonl: pass data\.path=FILE"),
    ("export_head", [], None, r"out is required: pass out=DIR"),
    # item 18a: a GPU trainer without a GPU (Lightning's "No supported gpu backend found!" traceback before)
    ("train", ["trainer=ddp"], no_gpu, r"trainer\.accelerator=gpu needs a GPU, .* trainer\.accelerator=cpu"),
    # item 18b: the Triton kernel on a CPU outside Triton's interpreter
    ("generate", ["kernel=triton", "model.device=cpu"], lambda mp, tmp: mp.delenv("TRITON_INTERPRET", raising=False),
     r"model\.attn_backend=triton \(kernel=triton\) runs on CUDA, .*kernel=sdpa or kernel=auto.*TRITON_INTERPRET=1"),
    # item 18d: an output path that is a file, or lies below one, for every entry point that writes one
    ("generate", ["paths.run_dir={file}/run"], None, r"paths\.run_dir='{file}/run' lies below {file}, which is a file"),
    ("calibrate", ["out={file}/tree.yaml"], None, r"out='{file}/tree\.yaml' lies below {file}, which is a file"),
    ("calibrate", ["out={tmp}"], None, r"out='{tmp}' is a directory; pass the path of a file to write"),
    ("export_head", ["out={file}/head"], None, r"out='{file}/head' lies below {file}, which is a file"),
    ("regenerate", ["input={file}", "out_dir={file}/sub"], None, r"out_dir='{file}/sub' lies below {file}"),
    ("train", ["export_dir={file}/head"], None, r"export_dir='{file}/head' lies below {file}, which is a file"),
    ("pretrain", ["paths.run_dir={file}"], None, r"paths\.run_dir='{file}' is a file; pass a directory"),
    # item 10: prompt text that never ends or is too large, from a file or stdin (item 18c: stdin not UTF-8)
    ("generate", ["prompt_file=/dev/zero"], None, r"prompt_file='/dev/zero' is not a regular file"),
    ("generate", ["prompt_file={file}"], lambda mp, tmp: mp.setenv("TREEDEC_PROMPT_MAX_BYTES", "8"),
     r"prompt_file='{file}' holds 16 bytes, over the 8-byte cap on prompt text; .*TREEDEC_PROMPT_MAX_BYTES=<bytes>"),
    ("generate", ["prompt_file=-"], stdin_of(b"def f(x):\n    return x\n" * 4, cap=80),
     r"prompt_file=- \(stdin\) holds more than 80 bytes, over the 80-byte cap"),
    ("generate", ["prompt_file=-"], stdin_of(b"def f():\n    return '\xff\xfe'\n"),
     r"prompt_file=- \(stdin\) is not UTF-8 text \(binary data at byte 21\); pipe UTF-8 text in"),
    # issue 46 item 1: a local config that is not YAML (a ~95-line yaml.parser traceback before)
    ("generate", [LOCAL], local_config("# @package _global_\nmodel:\n  device: [cpu\n"),
     r"{tmp}/conf/local/default\.yaml line 3: not valid YAML \(while parsing a flow sequence; expected ',' or "
     r"'\]', but got '<stream end>'\); close the list with \]"),
    ("train", [LOCAL], local_config("# @package _global_\nmodel:\n\tdevice: cpu\n"),
     r"{tmp}/conf/local/default\.yaml line 3: not valid YAML \(.*found character '\\t'.*\); indent with spaces"),
    # item 12: Hydra's composition errors (several lines of Hydra's own, no Error: before)
    ("generate", ["experiment=nonexistent"], None,
     r"experiment=nonexistent: the config group experiment has no option 'nonexistent'\. Pass experiment=<one of: "
     r"tree_sweep \(generate\), which_tree \(bench\)>"),
    ("bench", ["experiment=nonexistent"], None, r"experiment=nonexistent: the config group experiment has no option"),
    ("generate", ["experiment=which_tree"], None,
     r"experiment=which_tree is an experiment of bench, not of generate: run python -m treedec\.bench "
     r"experiment=which_tree$"),
    ("train", ["experiment=which_tree"], None, r"experiment=which_tree is an experiment of bench, not of train"),
    ("generate", ["tree=nonexistent"], None,
     r"tree=nonexistent: the config group tree has no option 'nonexistent'\. Pass tree=<one of: auto, best_first, "
     r"chain, dynamic, .*static>"),
    ("generate", ["tree=dynamic", "tree.detph=5"], None,
     r"tree\.detph=5: generate has no key tree\.detph\. Did you mean tree\.depth\? Keys of tree: total_tokens, depth"),
    ("generate", [LOCAL], local_config("# @package _global_\n- model\n"),
     r"{tmp}/conf/local/default\.yaml holds a list, not a mapping of keys: write `key: value` lines"),
    ("bench", [LOCAL], local_config("# @package _global_\nmodel:\n  devcie: cpu\n"),
     r"{tmp}/conf/local/default\.yaml line 3: bench has no key model\.devcie\. Did you mean model\.device\? Keys of "
     r"model: path, dtype, device, attn_backend; fix or remove it"),
    ("generate", [LOCAL], local_config(""),
     r"{tmp}/conf/local/default\.yaml is empty or lacks the first line `# @package _global_`, so its keys land "
     r"under `local`.*make `# @package _global_` its first line"),
    ("calibrate", [LOCAL], local_config("model:\n  device: cpu\n"),
     r"{tmp}/conf/local/default\.yaml is empty or lacks the first line `# @package _global_`"),
    ("generate", ["prompt=def f(x):"], None,  # what the shell leaves of make run ARGS="prompt='def f(x):'" before
     r"cannot read the override 'prompt=def f\(x\):' \(mismatched input '\(' expecting <EOF>\): .*quote the value "
     r"for Hydra: 'prompt=\"def f\(x\):\"'"),
    ("pretrain", ["model_arch=tiny_cod"], None,
     r"model_arch=tiny_cod: the config group model_arch has no option 'tiny_cod'\. Did you mean "
     r"model_arch=tiny_code\?"),
    ("regenerate", ["max_new_tokens=many"], None,
     r"max_new_tokens=many: Value 'many' of type 'str' could not be converted to Integer"),
    ("export_head", ["formt=eagle3"], None, r"formt=eagle3: export_head has no key formt\. Did you mean format\?"),
], ids=MISTAKES)
def test_user_mistakes_are_one_error_line(name, overrides, setup, message, tmp_path, a_file, monkeypatch):
    """Each mistake stops the entry point with one ``Error:`` line naming the key (or file) and the fix, before any
    model loads or any file is written (the run dir is never made)."""
    fill = {"file": a_file, "tmp": tmp_path}
    overrides = [o.format(**fill) for o in overrides]
    if not any(o.startswith("paths.run_dir=") for o in overrides):
        overrides.append(f"paths.run_dir={tmp_path / 'run'}")
    if setup is not None:
        setup(monkeypatch, tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as e:
        run_entry_point(name, overrides, monkeypatch)
    text = str(e.value.code)
    assert "\n" not in text and text.startswith("Error: "), text
    assert re.search(message.format(**{k: re.escape(str(v)) for k, v in fill.items()}), text), text
    assert not (tmp_path / "run").exists()



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
