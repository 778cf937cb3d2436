"""The table of user mistakes, each run through its entry point as a user would type it: one ``Error: ...`` line
naming the key (or file) and the fix, before any model loads or any file is written (treedec/cli.py; the contract
once per entry point, as a real subprocess: tests/test_cli.py)."""
from __future__ import annotations

import re
import sys

import pytest

from tests.helpers import compose_config, entry_module, local_config
from treedec.cli import entry


def entry_run(name: str):
    """The task body an entry point wraps in :func:`entry` (its ``run``; bench's is the harness's)."""
    import importlib

    return importlib.import_module("treedec.bench.harness").run if name == "bench" else entry_module(name).run


def run_entry_point(name: str, args: list[str], monkeypatch) -> None:
    """``python -m treedec.<name> <args>``, in-process: a config that Hydra cannot compose goes through the real
    command (:func:`treedec.cli.launch` around the entry's Hydra main, which stops before any task code); one that
    composes is handed to the entry's task body (its ``run`` under :func:`entry`), which must stop before any work."""
    from treedec.cli import launch

    searchpath = [f"hydra.searchpath=[file://{a.split('=', 1)[1]}]" for a in args if a.startswith("--config-dir=")]
    try:
        cfg = compose_config(name, [a for a in args if not a.startswith("--")] + searchpath, hydra=True)
    except Exception:
        monkeypatch.setattr(sys, "argv", [f"treedec.{name}", *args])
        launch(name, entry_module(name).main)
        raise AssertionError(f"python -m treedec.{name} {' '.join(args)} ran without an error") from None
    entry(entry_run(name))(cfg)


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
            "46.12-pretrain-group", "46.12-regenerate-type", "46.12-export-key",
            # issue 46: a one-pass (P-EAGLE) head where the entry point cannot use it, and its block size
            "46.3-init-kind", "46.9-block", "49-dflash-layers", "46.7-export-one-pass", "50-export-dflash",
            "50-peagle-no-target", "46.5-bench-all-skipped"]


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
     r"tree_sweep \(generate\), which_head \(bench\), which_tree \(bench\)>"),
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
    # items 3, 9, 7, 5: a one-pass head trained, exported or benched where it cannot work (issue 49: a DFlash drafter
    # of no layers; calibrate measures one-pass heads now)
    ("train", ["init_from=tiny-code-parallel"], None,  # the default draft_arch=eagle
     r"init_from=tiny-code-parallel is a one-pass \(P-EAGLE, kind parallel\) head, but draft_arch\.kind=eagle trains "
     r"an EAGLE-1/2 head: pass draft_arch=parallel to fine-tune it$"),
    ("train", ["draft_arch=parallel", "draft_arch.block_size=100000"], None,
     r"draft_arch\.block_size=100000: a one-pass head drafting 100000 positions needs 100001 positions of "
     r"context .*; lower draft_arch\.block_size"),
    ("train", ["draft_arch=dflash", "draft_arch.draft_layers=0"], None,
     r"draft_arch\.draft_layers=0: a whole number >= 1 of decoder layers \(DFlash's drafters have 1 to 8\)$"),
    ("export_head", ["draft=tiny_code_parallel", "format=eagle3", "out={tmp}/x"], None,
     r"draft\.path=tiny-code-parallel is kind 'parallel', so it exports as format=peagle \(not eagle3\): .*$"),
    ("export_head", ["draft=tiny_code_dflash", "format=eagle3", "out={tmp}/x"], None,
     r"draft\.path=tiny-code-dflash is kind 'dflash', which no engine layout treedec writes holds .*: use its treedec "
     r"directory as it is \(python -m treedec\.generate draft=path draft\.path=tiny-code-dflash\)$"),
    ("export_head", ["draft=tiny_code_parallel", "format=peagle", "target=/nowhere/model", "out={tmp}/x"], None,
     r"format=peagle carries the target's embedding table, and the target '/nowhere/model' does not load .*: pass "
     r"target=<the target model's directory>$"),
    ("bench", ["bench.draft_heads=[tiny_code_parallel]", "bench.methods=[vanilla,dynamic]"], None,
     r"bench\.methods=\['vanilla', 'dynamic'\]: every tree method was skipped, so the bench would compare nothing: "
     r"dynamic@tiny_code_parallel \(DynamicPolicy drafts node by node.*\); choose methods these heads can draft "
     r"\(bench\.methods=\[vanilla,\.\.\.\] from tiny_code_parallel: chain, .*\)$"),
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
    assert not (tmp_path / "run").exists() and not (tmp_path / "x").exists()
