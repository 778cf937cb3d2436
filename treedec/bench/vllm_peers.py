"""vLLM as a bench peer, on the same model, heads and prompts (``pip install -e ".[vllm]"``; :mod:`treedec.engines.vllm`).

* ``vllm``: vLLM's own vanilla decoding.
* ``vllm_eagle``, ``vllm_eagle3``, ``vllm_peagle``: vLLM's speculative decoding with the bench's head of that export
  format (the first of ``bench.draft_heads``, or the ``draft`` group's, whose kind exports to it), exported into the
  run directory, drafting ``bench.vllm_tokens`` tokens (a chain: compare it with ``chain`` at the same depth).

Every vLLM engine runs in one child process with the bench's threads and dtype, before treedec's timing starts: each
prompt alone (batch 1), after one warm-up prompt, ``bench.repeats`` passes; a prompt's time is the median of its
passes. The rows report tok/s, τ (vLLM's acceptance length) and token identity with treedec's vanilla (a peer's
mismatch is reported; it fails the run only with ``bench.strict_peers``). Without vLLM they are skipped, with why.
"""
from __future__ import annotations

import logging
import statistics
import warnings
from collections import Counter
from pathlib import Path

import torch
from omegaconf import DictConfig

from treedec.bench.methods import Method, Prompt, RunOutput
from treedec.engines.vllm import INSTALL_HINT, EngineRun, run_vllm, vllm_available
from treedec.heads import load_head
from treedec.heads.checkpoint import head_summary
from treedec.heads.export import export_head
from treedec.heads.formats.write import FORMAT_OF_KIND
from treedec.models.paths import resolve_path

log = logging.getLogger("treedec.bench")
VLLM_PEERS = {"vllm": None, "vllm_eagle": "eagle", "vllm_eagle3": "eagle3", "vllm_peagle": "peagle"}  # -> format


def _export(fmt: str, head_paths: dict[str, str], target, out: Path) -> tuple[Path | None, str]:
    """(the export directory of the first head whose kind exports as ``fmt``, or None; which head, or why none)."""
    for short, path in head_paths.items():
        if FORMAT_OF_KIND.get(head_summary(path)["kind"]) != fmt:
            continue
        head = load_head(path, dtype=None, quantize=None)  # the file's own weights, never a quantized copy
        if fmt == "peagle":
            head.bind(target)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (an EAGLE-1/2 export drafts over the whole vocabulary: said in docs)
            return export_head(head, out / f"vllm_{fmt}_{short}", fmt), short
    return None, f"no head of the bench exports as format={fmt} (bench.draft_heads: {', '.join(head_paths) or 'none'})"


def _method(name: str, out, prompts: list[Prompt], info: dict) -> Method:
    index = {p.id: i for i, p in enumerate(prompts)}

    def fn(p: Prompt, seed: int) -> RunOutput:
        i = index[p.id]
        toks = out.tokens[i]
        steps = out.steps(i)
        # τ as treedec counts it: the tokens of the decoding passes (the prefill gives the first) per pass
        return RunOutput(toks, max(steps, 1), max(len(toks) - 1, 0), steps + 1, {},
                         Counter(out.accepted[i]) if out.accepted else Counter(),
                         seconds=statistics.median(t[i] for t in out.seconds))

    return Method(name, "peer", True, fn, {"policy": None, "peer": name, **info})


def build_vllm_peers(cfg: DictConfig, target, head_paths: dict[str, str], eos_ids: list[int], prompts: list[Prompt],
                     run_dir: Path) -> tuple[list[Method], dict[str, str]]:
    """The vLLM peers of ``bench.peers`` (run now, in one child process) as methods, and the skipped ones with why.
    ``head_paths``: the bench's heads, short name -> path."""
    bench = cfg.bench
    names = [n for n in dict.fromkeys(bench.get("peers") or []) if n in VLLM_PEERS]
    if not names:
        return [], {}
    if not vllm_available():
        log.warning("skipping peers %s: vLLM is not installed", names)
        return [], {n: f"vLLM is not installed: {INSTALL_HINT}" for n in names}
    k = int(bench.vllm_tokens)
    runs, skipped, info = [], {}, {}
    for name in names:
        fmt = VLLM_PEERS[name]
        if fmt is None:
            runs.append(EngineRun(name))
            continue
        where, which = _export(fmt, head_paths, target, run_dir)
        if where is None:
            skipped[name] = which
            continue
        runs.append(EngineRun(name, str(where), fmt, k))
        info[name] = {"head": which, "export": str(where), "num_speculative_tokens": k}
    if not runs:
        return [], skipped
    log.info("vLLM peers %s: one child process, %d threads", [r.name for r in runs], torch.get_num_threads())
    outs = run_vllm(resolve_path(cfg.model.path), [p.ids for p in prompts], int(bench.max_new_tokens), runs,
                    dtype=str(target.dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                    stop_ids=list(eos_ids), passes=max(int(bench.repeats), 1))
    methods = []
    for r in runs:
        out = outs[r.name]
        log.info("%s: engine start %.1f s, acceptance length %.2f", r.name, out.start_s, out.acceptance_length)
        methods.append(_method(r.name, out, prompts, {**info.get(r.name, {}), "engine_start_s": out.start_s}))
    return methods, skipped


__all__ = ["VLLM_PEERS", "build_vllm_peers"]
