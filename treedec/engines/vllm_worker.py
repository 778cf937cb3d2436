"""The child process of :func:`treedec.engines.vllm.run_vllm`: ``python -m treedec.engines.vllm_worker REQUEST OUT``.

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


def decode(llm, prompts: list[list[int]], max_new_tokens: int, stop_ids, spec: bool,
           passes: int) -> tuple[list, list, list]:
    """(tokens per prompt, acceptance histogram per prompt, seconds per pass per prompt): each prompt alone (batch 1,
    as treedec's bench times it), every prompt once per pass, after one warm-up prompt."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=not stop_ids,
                            stop_token_ids=list(stop_ids or []))
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
    from vllm import LLM

    req = json.loads(request.read_text())
    results = {}
    for run in req["runs"]:
        spec = run["spec"]
        t = time.perf_counter()
        extra = {"per_request_spec_decode_metrics": "summary"} if spec else {}
        llm = LLM(model=req["target"], speculative_config=spec, enforce_eager=True, dtype=req["dtype"],
                  max_model_len=int(req.get("max_model_len", 1024)), kv_cache_memory_bytes=1 << 29, seed=0,
                  disable_log_stats=False, **extra)
        start = time.perf_counter() - t
        tokens, hists, seconds = decode(llm, req["prompts"], req["max_new_tokens"], req["stop_ids"], bool(spec),
                                        int(req.get("passes", 1)))
        results[run["name"]] = {"tokens": tokens, "accepted": hists, "start_s": start, "seconds": seconds}
        del llm
        gc.collect()
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(results))
    os.replace(tmp, out)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
