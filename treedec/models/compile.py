"""A compiled static-shape forward (gpt-fast style) for ``compile=true``.

``Transformer.forward(..., for_compile=True)`` attends over the whole preallocated cache with a
mask built on the device and writes K/V with index ops at the device-side lengths, so for a
fixed number of new tokens T its graph never changes: ``torch.compile(fullgraph=True,
dynamic=False)`` traces it once per T (pad trees to a fixed size per policy) and every later
step replays it. On CPU that is inductor's C++ kernels; on CUDA ``mode="reduce-overhead"``
adds CUDA graphs, for which the cache buffers are marked as static addresses.
"""
from __future__ import annotations

from typing import Callable

import torch

from treedec.models.cache import KVCache
from treedec.models.llama import ModelOutput, Transformer

StaticForward = Callable[..., ModelOutput]


def compile_forward(model: Transformer, mode: str | None = None) -> StaticForward:
    """``fn(input_ids, cache, position_ids, tree_mask=None, logits="all", layer_inputs=()) -> ModelOutput``, compiled.

    Equivalent to ``model(input_ids, cache, position_ids=..., tree_mask=..., logits=..., layer_inputs=...,
    for_compile=True)`` (``layer_inputs``: the layer ids an EAGLE-3 head reads; a constant per graph).
    ``mode`` defaults to inductor's default on CPU and ``"reduce-overhead"`` on CUDA. The first
    call for each T (and each ``logits`` choice) compiles; time it apart from decoding. The
    caller keeps room in the cache (``cache.check_room``): the static path does not look.
    """
    cuda = model.device.type == "cuda"
    if mode is None and cuda:
        mode = "reduce-overhead"

    def step(input_ids, cache, position_ids, tree_mask=None, logits="all", layer_inputs=()):
        return model(input_ids, cache, position_ids=position_ids, tree_mask=tree_mask, logits=logits,
                     layer_inputs=layer_inputs, for_compile=True)

    # On a CPU, inductor's weight freezing (pre-packed oneDNN weights, folded constants) and its C++
    # wrapper (no Python between kernels) are what make a compiled pass cheaper than eager: a 6-token
    # verify of the bundled model 4.7 -> 3.2 ms, 26 tokens 6.1 -> 4.2 ms (docs/benchmarks.md).
    options = None if cuda else {"freezing": True, "cpp_wrapper": True}
    compiled = torch.compile(step, mode=mode, fullgraph=True, dynamic=False, options=options)
    if not cuda:
        return compiled

    def run(input_ids, cache: KVCache, position_ids, tree_mask=None, logits="all", layer_inputs=()):
        for t in (cache.k, cache.v, cache.lengths):  # CUDA graphs replay in place: the buffers must not move
            torch._dynamo.mark_static_address(t)
        return compiled(input_ids, cache, position_ids, tree_mask, logits, layer_inputs)

    return run


__all__ = ["compile_forward"]
