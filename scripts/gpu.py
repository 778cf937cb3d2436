"""The prepared GPU check, run from the repo root: ``python scripts/gpu.py --out DIR`` (one command, under 8 minutes).

A device script, not library code: it lives outside the ``treedec`` package and puts the repo root
(its parent folder) on ``sys.path``, so the repo's treedec runs whether or not it is installed.

Runs, each step in a subprocess with its own timeout, carrying on after a failure:

1. ``tests_attention_cuda``: ``pytest tests/attention -m cuda`` (the Triton kernel on the GPU, bf16/fp16, split-K)
2. ``kernel``: ``python -m treedec.bench.kernel --device cuda --dtype bf16`` (7B-like heads: µs and KV GB/s per backend)
3. ``bench_triton``: ``python -m treedec.bench`` with ``kernel=triton`` on the bundled model in bf16 (+ peers)
4. ``bench_sdpa``: the same with ``kernel=sdpa`` (no peers: they do not depend on the kernel)
5. ``tests_attention``: the rest of ``tests/attention`` (every backend test runs on CUDA when there is one)
6. ``kernel_tiny``: the kernel benchmark at the bundled model's shape (8 heads / 2 KV heads, head_dim 32)

and writes into DIR (at most 8 files, so that a device run brings them all back):
``summary.json`` (every step's status, time and output tail, and the key figures), ``summary.md``
(the tables), ``log.txt`` (all output), ``kernel.json``, ``kernel_tiny.json``,
``bench_triton.json`` and ``bench_sdpa.json`` (the benches' metrics.json). Exit status 0 only
when every step passed.

Steps run in priority order against one deadline (``--budget`` seconds, default 470); a step
gets at most what is left, and one that cannot start is marked skipped. When the bundled
model is missing, the benches run on a random model of the same shape (τ then means nothing;
the summary says so).

Missing Python packages (the device image lacks hydra-core and omegaconf) install from wheels
given with ``--wheels DIR`` (``pip install --no-index``, into a folder of the work dir). Prepare
them on a machine with network access, in the repo root::

    echo /.whl/ >> .git/info/exclude
    python scripts/gpu.py --prepare-wheels .whl

then on the GPU machine (e.g. the device tool, with ``carry: [".whl"]``)::

    python3 scripts/gpu.py --out $OUT --wheels .whl
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDED = ("torch", "triton", "hydra", "omegaconf", "safetensors", "tokenizers", "pytest", "jinja2")
WHEEL_PACKAGES = ("hydra-core", "omegaconf", "antlr4-python3-runtime")
STEPS = ("tests_attention_cuda", "kernel", "bench_triton", "bench_sdpa", "tests_attention", "kernel_tiny")


def prepare_wheels(dest: str) -> int:
    """Build/download pure-Python wheels of hydra-core, omegaconf and antlr4 (the installed versions) into ``dest``."""
    from importlib.metadata import PackageNotFoundError, version

    specs = []
    for name in WHEEL_PACKAGES:
        try:
            specs.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            specs.append(name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dest, *specs]
    print("+", " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def pytest_status(output: str, rc: int | None) -> str | None:
    """``skipped`` when a pytest run ran nothing (every test skipped or deselected, or none collected), else None.

    pytest exits 0 when all tests skip (CUDA tests on a CPU machine), which must not read as "ok".
    """
    lines = [ln for ln in output.strip().splitlines() if ln.strip()]
    tail = lines[-1] if lines else ""
    counts = dict((word, int(n)) for n, word in re.findall(r"(\d+) (passed|failed|errors?|xfailed|xpassed)", tail))
    if rc == 5 or (rc == 0 and not any(counts.values())):
        return "skipped"
    return None


class Runner:
    def __init__(self, out: Path, work: Path, budget: float, env: dict):
        self.out, self.work, self.env = out, work, env
        self.deadline = time.monotonic() + budget
        self.steps: list[dict] = []
        self.log = open(out / "log.txt", "a", buffering=1)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")

    def step(self, name: str, cmd: list[str], timeout: float, ok_codes=(0,), pytest: bool = False) -> dict:
        t = min(timeout, self.left() - 3)
        rec = {"name": name, "cmd": " ".join(cmd), "timeout_s": round(max(t, 0), 1)}
        if t < 15:
            rec.update(status="skipped", reason="out of time budget")
            self.note(f"== {name}: skipped (only {self.left():.0f}s of the budget left)")
            self.steps.append(rec)
            return rec
        self.note(f"== {name}: {rec['cmd']} (timeout {t:.0f}s)")
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, timeout=t, errors="replace")
            output, rc = p.stdout, p.returncode
            status = "ok" if rc in ok_codes else "failed"
            if pytest:
                status = pytest_status(output, rc) or status
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout or b""
            output = out.decode(errors="replace") if isinstance(out, bytes) else out
            rc, status = None, "timeout"
        except OSError as exc:
            output, rc, status = f"{type(exc).__name__}: {exc}", None, "failed"
        rec.update(status=status, rc=rc, seconds=round(time.monotonic() - t0, 1), tail=output[-3000:])
        if pytest and status == "skipped":
            rec["reason"] = "pytest ran no test: every one skipped or deselected (no GPU?)"
        self.log.write(output + "\n")
        self.note(f"== {name}: {status} (rc {rc}, {rec['seconds']}s)")
        self.steps.append(rec)
        return rec


def check_imports(wheels: str | None, work: Path, env: dict, runner_note) -> dict:
    """Which needed packages import; install the missing ones from ``wheels`` when given."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    info = {"missing": missing}
    if missing and wheels:
        site = work / "site"
        files = sorted(str(p) for p in Path(wheels).glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), *files]
        runner_note("+ " + " ".join(cmd))
        p = subprocess.run(cmd, capture_output=True, text=True)
        info["wheel_install"] = {"rc": p.returncode, "files": [Path(f).name for f in files], "tail": (p.stdout + p.stderr)[-1500:]}
        env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")])
        sys.path.insert(0, str(site))
        importlib.invalidate_caches()
        info["still_missing"] = [m for m in missing if importlib.util.find_spec(m) is None]
    return info


def environment() -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform()}
    try:
        import torch

        env.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    except Exception as exc:
        env["torch_error"] = repr(exc)
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception:
            env[mod] = None
    if shutil.which("nvidia-smi"):
        try:
            env["nvidia_smi"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                                "--format=csv,noheader"], capture_output=True, text=True,
                                               timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return env


def random_stack(work: Path) -> tuple[str, str]:
    """A random model + draft head of the bundled model's shape (when the bundled one is missing)."""
    import torch
    from omegaconf import OmegaConf

    from treedec.data.corpus import split_files, stdlib_root
    from treedec.data.tokenizer_train import train_tokenizer
    from treedec.heads import DraftConfig, build_head
    from treedec.models.checkpoint import save_pretrained
    from treedec.models.config import LlamaConfig
    from treedec.models.llama import Transformer

    corpus = work / "tok_corpus"
    root = stdlib_root()
    for f in split_files(root, "train")[:40]:
        (corpus / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / f, corpus / f)
    arch = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model_arch" / "tiny_code.yaml"))
    train_tokenizer(corpus, vocab_size=arch["vocab_size"], val_fraction=0.0, out=work / "tokenizer.json")
    torch.manual_seed(0)
    model = Transformer(LlamaConfig(**arch))
    save_pretrained(model, work / "random_target", tokenizer=str(work / "tokenizer.json"))
    build_head(DraftConfig.for_target(model.config, target="random")).save(work / "random_draft")
    return str(work / "random_target"), str(work / "random_draft")


def bench_table(metrics: dict) -> list[dict]:
    return [{"method": n, "tokens_per_s": e.get("tokens_per_s"), "tau": e.get("tau"), "speedup": e.get("speedup"),
             "identical_to_vanilla": e.get("identical_to_vanilla")} for n, e in metrics.get("methods", {}).items()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/gpu.py", description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder for summary.json, summary.md, log.txt and the result files")
    ap.add_argument("--work", default=None, help="scratch folder for Hydra run dirs (default: a temp dir)")
    ap.add_argument("--budget", type=float, default=470.0, help="seconds for all steps together")
    ap.add_argument("--wheels", default=None, help="folder of wheels for missing packages (pip --no-index)")
    ap.add_argument("--prepare-wheels", default=None, metavar="DIR", help="(on a networked machine) fill DIR and exit")
    ap.add_argument("--model", default="tiny-code", help="model.path for the benches")
    ap.add_argument("--draft", default="tiny-code-eagle", help="draft.path for the benches")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per bench")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="model.device for the benches (cpu: a dry run of this script)")
    ap.add_argument("--steps", default=None, help=f"comma list of steps to run (default all: {','.join(STEPS)})")
    args = ap.parse_args(argv)
    if args.prepare_wheels:
        return prepare_wheels(args.prepare_wheels)
    if not args.out:
        ap.error("--out is required")

    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="treedec_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # the real kernel, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), env.get("PYTHONPATH", "")] if p)
    sys.path.insert(0, str(ROOT))
    r = Runner(out, work, args.budget, env)
    summary: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "root": str(ROOT), "work": str(work)}
    summary["imports"] = check_imports(args.wheels, work, env, r.note)
    summary["environment"] = environment()
    r.note(json.dumps(summary["environment"]))
    py = [sys.executable]

    def write_summary() -> None:
        summary["steps"] = r.steps
        summary["elapsed_s"] = round(time.time() - t_start, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "summary.md").write_text(summary_md(summary, out))

    want = set(args.steps.split(",")) if args.steps else set(STEPS)
    unknown = want - set(STEPS)
    if unknown:
        ap.error(f"unknown --steps {sorted(unknown)}; choose from {', '.join(STEPS)}")

    def step(name: str, cmd: list[str], timeout: float) -> None:
        if name in want:
            r.step(name, cmd, timeout, pytest=name.startswith("tests_"))
            write_summary()

    pytest = py + ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
    step("tests_attention_cuda", pytest + ["tests/attention", "-m", "cuda"], 100)
    step("kernel", py + ["-m", "treedec.bench.kernel", "--device", "cuda", "--dtype", "bf16", "--repeats", "30",
                         "--out", str(out / "kernel.json")], 90)

    model, draft, random_model = args.model, args.draft, False
    if want & {"bench_triton", "bench_sdpa"}:
        try:
            from treedec.heads import BUNDLED_DRAFTS
            from treedec.models.checkpoint import resolve_path

            resolve_path(model)
            if not (Path(str(BUNDLED_DRAFTS.get(draft, draft))) / "draft_config.json").is_file():
                raise FileNotFoundError(f"no draft head at {draft}")
        except Exception as exc:
            r.note(f"bundled model/draft unavailable ({exc}); benches run on a random model of the same shape")
            try:
                model, draft = random_stack(work)
                random_model = True
            except Exception as exc2:
                r.note(f"could not build a random model: {type(exc2).__name__}: {exc2}")
        summary["bench_model"] = {"model": model, "draft": draft, "random_weights": random_model}

    common = [f"model.path={model}", f"draft.path={draft}", f"model.device={args.device}", "model.dtype=bfloat16",
              f"bench.n_prompts={args.prompts}", f"bench.max_new_tokens={args.new_tokens}",
              f"bench.repeats={args.repeats}", "bench.plots=false"]
    for kernel, peers, timeout in (("triton", None, 150), ("sdpa", "bench.peers=[]", 120)):
        run_dir = work / f"bench_{kernel}"
        cmd = py + ["-m", "treedec.bench", *common, f"kernel={kernel}", f"hydra.run.dir={run_dir}"]
        if peers:
            cmd.append(peers)
        step(f"bench_{kernel}", cmd, timeout)
        if (run_dir / "metrics.json").is_file():
            shutil.copyfile(run_dir / "metrics.json", out / f"bench_{kernel}.json")

    step("tests_attention", pytest + ["tests/attention", "-m", "not cuda", "-x"], 90)
    step("kernel_tiny", py + ["-m", "treedec.bench.kernel", "--device", "cuda", "--dtype", "bf16", "--heads", "8",
                              "--kv-heads", "2", "--head-dim", "32", "--prefix-lens", "128,512,1024",
                              "--tree-sizes", "16,32,64", "--repeats", "30", "--out", str(out / "kernel_tiny.json")], 45)

    # Key figures for the summary.
    figures: dict = {}
    for k in ("triton", "sdpa"):
        f = out / f"bench_{k}.json"
        if f.is_file():
            try:
                figures[f"bench_{k}"] = bench_table(json.loads(f.read_text()))
            except (json.JSONDecodeError, OSError) as exc:
                figures[f"bench_{k}"] = f"unreadable: {exc}"
    if isinstance(figures.get("bench_triton"), list) and isinstance(figures.get("bench_sdpa"), list):
        sd = {row["method"]: row["tokens_per_s"] for row in figures["bench_sdpa"]}
        figures["triton_over_sdpa_tokens_per_s"] = {row["method"]: row["tokens_per_s"] / sd[row["method"]]
                                                    for row in figures["bench_triton"]
                                                    if sd.get(row["method"]) and row["tokens_per_s"]}
    summary["figures"] = figures
    write_summary()
    r.note(f"wrote {out / 'summary.json'} and {out / 'summary.md'} ({summary['elapsed_s']}s)")
    failed = [s["name"] for s in r.steps if s["status"] != "ok"]
    if failed:
        r.note(f"steps not ok: {', '.join(failed)}")
    return 1 if failed else 0


def summary_md(summary: dict, out: Path) -> str:
    env = summary.get("environment", {})
    lines = [f"# treedec GPU check, {summary.get('started')}", "",
             f"{env.get('gpu', 'no GPU')}; torch {env.get('torch')} (CUDA {env.get('cuda')}), triton {env.get('triton')}, "
             f"transformers {env.get('transformers')}", "", "| step | status | seconds |", "|---|---|---:|"]
    for s in summary.get("steps", []):
        lines.append(f"| {s['name']} | {s['status']} | {s.get('seconds', '–')} |")
    bm = summary.get("bench_model")
    if bm and bm.get("random_weights"):
        lines += ["", "**The benches ran on random weights (the bundled model was missing): τ and speedups mean nothing.**"]
    for k in ("triton", "sdpa"):
        f = out / f"bench_{k}.json"
        if f.is_file():
            try:
                from treedec.bench.report import markdown

                lines += ["", f"## bench, kernel={k}", "", markdown(json.loads(f.read_text()))]
            except Exception as exc:
                lines += ["", f"## bench, kernel={k}: could not render ({exc})"]
    for name in ("kernel", "kernel_tiny"):
        f = out / f"{name}.json"
        if f.is_file():
            try:
                from treedec.bench.kernel import markdown as kmd

                res = json.loads(f.read_text())
                c = res["config"]
                lines += ["", f"## {name}: B={c['batch']} Hq={c['heads']} Hkv={c['kv_heads']} D={c['head_dim']} "
                          f"{c['dtype']}", "", kmd(res)]
            except Exception as exc:
                lines += ["", f"## {name}: could not render ({exc})"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
