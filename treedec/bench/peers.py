"""Peers: what a user would run instead of treedec, on identical weights, through ``transformers``.

* ``hf_greedy``: ``model.generate(do_sample=False)``: plain decoding, transformers' own loop; with
  ``bench.batch_sizes`` also batched (:func:`hf_generate_batch`: left padding and an attention mask).
* ``hf_prompt_lookup``: the same with ``prompt_lookup_num_tokens`` (n-gram drafts copied
  from the prompt; no draft model). Lossless greedy.
* ``hf_assisted``: assisted generation with ``assistant_model`` (a smaller model that shares
  the tokenizer). ``bench.assistant_path=auto`` (the default) uses the bundled 2-layer
  ``tiny-code-assistant`` (trained by treedec's own ``pretrain``) with the bundled target; a
  missing or unloadable assistant, or one of another vocabulary, is skipped with the reason. Lossless greedy.
* ``hf_sample``: ``model.generate(do_sample=True, temperature=T, top_p=..., top_k=...)`` at the settings
  of treedec's sampled rows, one row per ``bench.sample_temperatures`` (only with ``bench.sampling=true``).
  Each prompt's call runs under ``torch.manual_seed(bench.seed + i)`` inside ``torch.random.fork_rng``,
  so a pass is reproducible and the process's own random state is left alone.

The target's directory is loaded with ``AutoModelForCausalLM.from_pretrained`` in the same
dtype and on the same device as treedec's model (the bundled ``tiny-code`` is a Hugging Face
directory), and every call passes treedec's EOS ids, so a peer stops where treedec stops.
τ of a peer is its new tokens per target forward (counted with a forward hook on the target).

transformers (a test dependency, not the package's, and seconds to import) is imported where a peer runs.
"""
from __future__ import annotations

import importlib
import logging
import warnings

import torch
from omegaconf import DictConfig

from treedec.bench.methods import Method, Prompt, RunOutput, sample_settings, sampled_name
from treedec.config.bundled import assistant_path
from treedec.models.paths import resolve_path

log = logging.getLogger("treedec.bench")



def load_hf(path, dtype: torch.dtype, device):
    """``AutoModelForCausalLM.from_pretrained(path)`` in ``dtype`` on ``device``, in eval mode."""
    import transformers

    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover - older transformers
        pass
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype)
    return model.to(device).eval()


class ForwardCounter:
    """Counts calls of a module's forward (the target's passes, prefill included)."""

    def __init__(self, module: torch.nn.Module):
        self.n = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, *_):
        self.n += 1


def hf_method(name: str, model, max_new_tokens: int, eos_ids: list[int], sampling=None, **extra) -> Method:
    """A ``model.generate`` peer: greedy, or with ``sampling`` (SamplingParams) sampled and seeded per call."""
    counter = ForwardCounter(model)
    pad = eos_ids[0] if eos_ids else 0
    sample = sampling is not None and not sampling.greedy
    # top_k is always passed: transformers' own default (50) would otherwise cut what treedec keeps.
    mode = (dict(do_sample=True, temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                 top_k=int(sampling.top_k)) if sample else dict(do_sample=False))
    kwargs = dict(num_beams=1, max_new_tokens=max_new_tokens, eos_token_id=list(eos_ids), pad_token_id=pad,
                  **mode, **extra)
    devices = [model.device] if model.device.type == "cuda" else []

    def fn(p: Prompt, seed: int) -> RunOutput:
        ids = torch.tensor([p.ids], device=model.device)
        counter.n = 0
        with torch.inference_mode(), warnings.catch_warnings(), torch.random.fork_rng(devices=devices):
            warnings.simplefilter("ignore")  # generation-config deprecation chatter, not ours to fix
            if sample:
                torch.manual_seed(int(seed))
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        toks = out[0, ids.shape[1]:].tolist()
        # A batch of one is never padded after EOS, but cut at the first EOS to be safe.
        for i, t in enumerate(toks):
            if t in eos_ids:
                toks = toks[: i + 1]
                break
        fw = counter.n
        return RunOutput(toks, max(fw, 1), len(toks), fw, {})

    info = {"policy": None, "peer": name, **{k: v for k, v in extra.items() if k != "assistant_model"}}
    if not sample:
        return Method(name, "peer", True, fn, info)
    info["sampling"] = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    return Method(sampled_name(name, sampling.temperature), "peer", False, fn, info,
                  reference=sampled_name("vanilla_sample", sampling.temperature))


def hf_generate_batch(model, rows: list[list[int]], max_new_tokens: int, eos_ids: list[int]) -> tuple[list, int]:
    """Greedy ``model.generate`` of a ragged batch (left padding and an attention mask, as a server batches)
    -> (new tokens per row, cut after its first EOS; target forwards)."""
    pad = eos_ids[0] if eos_ids else 0
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=model.device)
    counter = ForwardCounter(model)
    try:
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                                 eos_token_id=list(eos_ids), pad_token_id=pad)
    finally:
        counter.handle.remove()
    toks = []
    for row in out[:, width:].tolist():  # a finished row is padded after its EOS: cut there
        stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
        toks.append(row if stop is None else row[: stop + 1])
    return toks, counter.n


def build_peers(cfg: DictConfig, target, eos_ids: list[int],
                assistant_note: str | None = None) -> tuple[list[Method], dict[str, str]]:
    """The peers named in ``bench.peers`` that can run here; returns (methods, skipped reasons).

    ``assistant_note``: why ``bench.assistant_path`` is what it is (from resolving ``auto``).
    """
    bench = cfg.bench
    names = [n for n in dict.fromkeys(bench.get("peers") or []) if n.startswith("hf_")]  # (vllm*: vllm_peers.py)
    skipped: dict[str, str] = {}
    settings = sample_settings(cfg) if "hf_sample" in names else []
    if "hf_sample" in names and not settings:  # a greedy run: the sampled peer has nothing to match
        names.remove("hf_sample")
        log.info("hf_sample runs only with bench.sampling=true (one row per bench.sample_temperatures)")
    if not names:
        return [], skipped
    try:  # every peer runs on transformers: without it they are all skipped
        importlib.import_module("transformers")
    except ImportError:
        for n in names:
            skipped[n] = "transformers is not installed (pip install transformers)"
        log.warning("skipping peers %s: transformers is not installed", names)
        return [], skipped
    assistant = None
    if "hf_assisted" in names:
        value, why = assistant_path(bench.get("assistant_path"), cfg.model.path)
        why = assistant_note or why
        if value is None:
            skipped["hf_assisted"] = why
        else:
            assistant = _assistant_dir(value, skipped)
        if assistant is None:
            names.remove("hf_assisted")
            log.info("skipping hf_assisted: %s", skipped["hf_assisted"])
        else:
            log.info("hf_assisted: %s", why)
    if not names:
        return [], skipped

    path = resolve_path(cfg.model.path)
    try:
        model = load_hf(path, target.dtype, target.device)
    except Exception as exc:  # a checkpoint transformers cannot read is a skipped peer, not a failed bench
        for n in names:
            skipped[n] = f"transformers could not load {path}: {type(exc).__name__}: {exc}"
        log.warning("skipping peers %s: transformers could not load %s (%s)", names, path, exc)
        return [], skipped
    n = int(bench.max_new_tokens)
    methods = []
    for name in names:
        if name == "hf_greedy":
            methods.append(hf_method(name, model, n, eos_ids))
        elif name == "hf_prompt_lookup":
            methods.append(hf_method(name, model, n, eos_ids,
                                     prompt_lookup_num_tokens=int(bench.prompt_lookup_num_tokens)))
        elif name == "hf_sample":
            methods += [hf_method(name, model, n, eos_ids, sampling=s) for s in settings]
        elif name == "hf_assisted":
            small = _load_assistant(assistant, model, target, skipped)
            if small is None:
                continue
            m = hf_method(name, model, n, eos_ids, assistant_model=small)
            m.info.update(assistant_path=str(assistant), assistant_layers=small.config.num_hidden_layers)
            methods.append(m)
    return methods, skipped


def _assistant_dir(value: str, skipped: dict[str, str]):
    """The assistant's directory, or None with the reason in ``skipped`` (a bundled one not trained yet)."""
    try:
        return resolve_path(value)
    except FileNotFoundError as exc:
        skipped["hf_assisted"] = f"no assistant model: {exc}"
        return None


def _load_assistant(path, model, target, skipped: dict[str, str]):
    """The assistant as a transformers model, or None (reason in ``skipped``) when it cannot assist ``model``."""
    try:
        small = load_hf(path, target.dtype, target.device)
    except Exception as exc:  # a broken assistant costs its peer, not the benchmark
        skipped["hf_assisted"] = f"transformers could not load the assistant {path}: {type(exc).__name__}: {exc}"
    else:
        if small.config.vocab_size == model.config.vocab_size:
            return small
        skipped["hf_assisted"] = (f"the assistant {path} has vocab_size {small.config.vocab_size}, the target "
                                  f"{model.config.vocab_size}: assisted generation needs the same tokenizer")
    log.warning("skipping hf_assisted: %s", skipped["hf_assisted"])
    return None


__all__ = ["ForwardCounter", "build_peers", "hf_generate_batch", "hf_method", "load_hf"]
