"""vLLM on treedec's model and exported heads (``pip install -e ".[vllm]"``: vLLM's CPU build on a machine without a
GPU): :func:`run_vllm` decodes a prompt set with vLLM's vanilla and speculative engines in one child process
(:mod:`treedec.engines.vllm_worker`, one engine at a time) and returns each engine's tokens, per-prompt acceptance
and times. The engine tests (tests/engines/test_vllm.py) prove every export format this way.

What vLLM calls each export (``format`` of ``python -m treedec.export_head``) is :data:`SPEC_METHOD`: an EAGLE-1/2
head is ``method: eagle``; EAGLE-3 is ``eagle3``; a one-pass head (``format=peagle``) is ``eagle3`` with
``parallel_drafting``. vLLM drafts a chain of ``num_speculative_tokens`` and accepts by the greedy chain rule, so
its acceptance equals treedec's ``ChainPolicy(k)`` with the same head.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

SPEC_METHOD = {"eagle": {"method": "eagle"}, "eagle3": {"method": "eagle3"},
               "peagle": {"method": "eagle3", "parallel_drafting": True}}
INSTALL_HINT = 'install vLLM\'s CPU build with: make vllm (or pip install -e ".[vllm]")'


@dataclass
class EngineRun:
    """One vLLM engine: vanilla (``draft`` None) or speculative with an exported head of ``fmt``, drafting ``k``."""

    name: str
    draft: str | None = None
    fmt: str | None = None
    k: int = 0

    def spec_config(self) -> dict | None:
        if self.draft is None:
            return None
        if self.fmt not in SPEC_METHOD or self.k < 1:
            raise ValueError(f"engine run {self.name!r}: format {self.fmt!r} with k={self.k}; vLLM serves "
                             f"{', '.join(SPEC_METHOD)} exports drafting k >= 1 tokens")
        return {**SPEC_METHOD[self.fmt], "model": str(self.draft), "num_speculative_tokens": self.k}


@dataclass
class EngineOutput:
    """One engine's decoding of the prompt set: tokens per prompt; per prompt, accepted drafts per step -> steps
    (speculative engines; vLLM's per-request histogram); seconds to start the engine; seconds per pass per prompt
    (each prompt alone, after a warm-up)."""

    tokens: list[list[int]]
    accepted: list[dict[int, int]] = field(default_factory=list)
    start_s: float = 0.0
    seconds: list[list[float]] = field(default_factory=list)

    def steps(self, i: int) -> int:
        """Target passes after the prefill for prompt ``i``: its speculative steps, else one per token after the
        first (which the prefill gives)."""
        return sum(self.accepted[i].values()) if self.accepted and self.accepted[i] else len(self.tokens[i]) - 1

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per speculative step over every prompt (1 + accepted drafts per step); 1.0 for vanilla."""
        steps = sum(n for h in self.accepted for n in h.values())
        return 1.0 + sum(k * n for h in self.accepted for k, n in h.items()) / steps if steps else 1.0


def vllm_available() -> bool:
    """Whether vLLM is installed (its import is left to the child process)."""
    return importlib.util.find_spec("vllm") is not None


def _child_env(threads: int | None) -> dict[str, str]:
    """The worker's environment: vLLM's engine core in the worker's own process, the device, its OpenMP threads."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.setdefault("VLLM_TARGET_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_vllm(target: str | os.PathLike, prompts: list[list[int]], max_new_tokens: int, runs: list[EngineRun],
             dtype: str = "float32", threads: int | None = None, stop_ids: list[int] | None = None, passes: int = 1,
             timeout_s: float = 1800.0) -> dict[str, EngineOutput]:
    """Decode ``prompts`` (token ids) greedily for ``max_new_tokens`` with each of ``runs`` in vLLM, on the target
    directory ``target`` (a Hugging Face directory: vLLM reads it, tokenizer included) -> outputs by run name.
    ``stop_ids``: tokens that end a prompt's output (None: none, every prompt gets ``max_new_tokens``).
    ``threads``: the child's OpenMP threads (None: vLLM's default); ``passes``: timed passes over the prompts."""
    if not vllm_available():
        raise RuntimeError(f"vLLM is not installed: {INSTALL_HINT}")
    request = {"target": str(target), "prompts": prompts, "max_new_tokens": max_new_tokens, "dtype": dtype,
               "stop_ids": stop_ids, "passes": passes, "cpu": not torch.cuda.is_available(),
               "runs": [{"name": r.name, "spec": r.spec_config()} for r in runs]}
    env = _child_env(threads)
    with tempfile.TemporaryDirectory(prefix="treedec-vllm-") as tmp:
        req, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        req.write_text(json.dumps(request))
        done = subprocess.run([sys.executable, "-m", "treedec.engines.vllm_worker", str(req), str(out)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0 or not out.is_file():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
            raise RuntimeError(f"vLLM's worker failed (exit {done.returncode}):\n{tail}")
        got = json.loads(out.read_text())
    return {name: EngineOutput(r["tokens"], [{int(k): n for k, n in h.items()} for h in r["accepted"]],
                               r["start_s"], r["seconds"]) for name, r in got.items()}


class VllmServer:
    """One vLLM engine kept up in a child process for a whole job (``regenerate engine=vllm``): :meth:`generate`
    sends a batch of prompts and gets their continuations; vLLM batches them continuously. Its log goes to
    ``log_path``. ``llm_args``: more arguments of ``vllm.LLM`` (``tensor_parallel_size``, ``gpu_memory_utilization``,
    ...); on a CPU the engine runs eagerly with a 1 GiB KV cache unless they say otherwise."""

    def __init__(self, target: str | os.PathLike, dtype: str, max_model_len: int, log_path: str | os.PathLike,
                 llm_args: dict | None = None, threads: int | None = None):
        if not vllm_available():
            raise RuntimeError(f"engine=vllm needs vLLM: {INSTALL_HINT}")
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cpu = not torch.cuda.is_available()
        self._config = self.log_path.with_name(self.log_path.name + ".json")
        self._config.write_text(json.dumps({"target": str(target), "dtype": dtype, "max_model_len": int(max_model_len),
                                            "cpu": cpu, "llm_args": dict(llm_args or {})}))
        self._log = self.log_path.open("a")
        self._proc = subprocess.Popen([sys.executable, "-m", "treedec.engines.vllm_worker", "--serve", str(self._config)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                      env=_child_env(threads))
        self._read()  # {"ready": true}, or the engine's failure

    def _read(self) -> dict:
        line = self._proc.stdout.readline()
        if not line:
            self._proc.wait()
            self._log.flush()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise ValueError(f"vLLM's engine stopped (exit {self._proc.returncode}): {tail[0]}; check the model and "
                             f"vllm_args (its log: {self.log_path})")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, seeds: list[int], stop_ids: list[int],
                 temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0) -> list[list[int]]:
        """Each prompt's continuation (its stop token included where it stopped on one), sampled with its seed."""
        req = {"prompts": prompts, "max_new_tokens": max_new_tokens, "seeds": seeds, "stop_ids": stop_ids,
               "temperature": temperature, "top_p": top_p, "top_k": top_k}
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        return self._read()["tokens"]

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._log.close()
        self._config.unlink(missing_ok=True)


__all__ = ["EngineOutput", "EngineRun", "SPEC_METHOD", "VllmServer", "run_vllm", "vllm_available"]
