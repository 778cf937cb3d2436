"""The child process of :func:`treedec.engines.vllm.run_vllm` (``python -m treedec.engines.vllm_worker REQUEST OUT``)
and of :class:`treedec.engines.vllm.VllmServer` (``python -m treedec.engines.vllm_worker --serve CONFIG``).

Reads the request (target directory, prompts as token ids, runs, passes), starts one vLLM engine per run in turn,
decodes every prompt alone and greedily (after one warm-up prompt), once per pass, and writes tokens, each prompt's
acceptance histogram (``per_request_spec_decode_metrics``) and each pass's seconds per prompt to OUT as JSON
(written beside, then renamed).

vLLM's CPU build pulls PyPI's torchvision, torchaudio and torchcodec, CUDA builds that fail beside a CPU torch
(``operator torchvision::nms does not exist``). Text generation needs none of them, so they are hidden from this
process before vLLM loads (transformers then treats them as absent); nothing is uninstalled.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

for _name in ("torchvision", "torchaudio", "torchcodec"):
    sys.modules.setdefault(_name, None)  # type: ignore[arg-type]  (import of it: ImportError; find_spec: None)


def engine(target: str, dtype: str, max_model_len: int, cpu: bool, kv_bytes: int, **more):
    """A ``vllm.LLM`` of the target; on a CPU eager, with a KV cache of ``kv_bytes`` (vLLM would size it from the
    machine's whole memory and refuse when that is not free)."""
    from vllm import LLM

    on_cpu = {"enforce_eager": True, "kv_cache_memory_bytes": kv_bytes} if cpu else {}
    return LLM(model=target, dtype=dtype, max_model_len=int(max_model_len), seed=0, **{**on_cpu, **more})


def sampling(max_new_tokens: int, stop_ids, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None):
    """vLLM's SamplingParams for treedec's settings: greedy at temperature 0; top_k 0 and top_p 1 are off; the stop
    ids end an output (none: never stop early)."""
    from vllm import SamplingParams

    greedy = float(temperature) == 0.0
    return SamplingParams(temperature=float(temperature), top_p=1.0 if greedy else float(top_p),
                          top_k=-1 if greedy or not top_k else int(top_k), seed=seed, max_tokens=int(max_new_tokens),
                          stop_token_ids=list(stop_ids or []), ignore_eos=not stop_ids)


def decode(llm, prompts: list[list[int]], max_new_tokens: int, stop_ids, spec: bool,
           passes: int) -> tuple[list, list, list]:
    """(tokens per prompt, acceptance histogram per prompt, seconds per pass per prompt): each prompt alone (batch 1,
    as treedec's bench times it), every prompt once per pass, after one warm-up prompt."""
    params = sampling(max_new_tokens, stop_ids)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    tokens, hists, seconds = [], [], []
    for r in range(passes):
        times = []
        for p in prompts:
            t = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
            times.append(time.perf_counter() - t)
            if r == 0:
                tokens.append(list(out.token_ids))
                m = out.spec_decode_metrics if spec else None
                hists.append({} if m is None else {j: n for j, n in enumerate(m.histogram) if n})
        seconds.append(times)
    return tokens, hists, seconds


def main(request: Path, out: Path) -> None:
    req = json.loads(request.read_text())
    results = {}
    for run in req["runs"]:
        spec = run["spec"]
        t = time.perf_counter()
        extra = {"per_request_spec_decode_metrics": "summary"} if spec else {}
        llm = engine(req["target"], req["dtype"], req.get("max_model_len", 1024), req["cpu"], 1 << 29,
                     speculative_config=spec, disable_log_stats=False, **extra)
        start = time.perf_counter() - t
        tokens, hists, seconds = decode(llm, req["prompts"], req["max_new_tokens"], req["stop_ids"], bool(spec),
                                        int(req.get("passes", 1)))
        results[run["name"]] = {"tokens": tokens, "accepted": hists, "start_s": start, "seconds": seconds}
        del llm
        gc.collect()
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    os.replace(tmp, out)


def serve(config: Path) -> None:
    """One engine for the whole run: a JSON request per line on stdin (prompts, max_new_tokens, temperature, top_p,
    top_k, seeds, stop_ids) -> a JSON line of tokens per prompt on the original stdout, once ``{"ready": true}`` has
    been said. vLLM's own output (its log goes to stdout) is moved to stderr so that it never mixes in."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    cfg = json.loads(config.read_text())
    llm = engine(cfg["target"], cfg["dtype"], cfg["max_model_len"], cfg["cpu"], 1 << 30, **cfg["llm_args"])
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        params = [sampling(req["max_new_tokens"], req["stop_ids"], req["temperature"], req["top_p"], req["top_k"],
                           seed) for seed in req["seeds"]]
        outs = llm.generate([{"prompt_token_ids": p} for p in req["prompts"]], params, use_tqdm=False)
        replies.write(json.dumps({"tokens": [list(o.outputs[0].token_ids) for o in outs]}) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(Path(sys.argv[2]))
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]))
