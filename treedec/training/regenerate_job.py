"""The job ``python -m treedec.regenerate`` runs: the input's records decoded by the target into atomic shards
under ``trainer.predict`` (the shards, manifest, locks and stats: :mod:`treedec.training.regen_state`)."""
from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from treedec.data.chat import ChatRenderer
from treedec.data.files import file_fingerprint
from treedec.engines.vllm import VllmServer
from treedec.models.checkpoint import read_config, resolve_dtype
from treedec.models.paths import resolve_path
from treedec.models.tokenizer import load_tokenizer
from treedec.training.predict import SpeculativeGenerationModule
from treedec.training.regen_requests import ChatRequest, Record, TextRequest, read_records
from treedec.training.regen_state import (
    Preempted,
    ShardData,
    ShardWriter,
    StopOnSigterm,
    check_manifest,
    finished_stats,
    summarize,
)
from treedec.training.vllm_predict import VllmGenerationModule
from treedec.tree.policies import AutoPolicy, ChainPolicy

log = logging.getLogger("treedec.regenerate")  # the command's own name, as in its other messages
DECODING_KEYS = ("model", "draft", "tree", "sampling", "max_new_tokens", "prompt_tokens", "chat_template",
                 "format", "batch_size", "shard_size", "on_error", "seed", "engine")  # what a resumed run must share
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143: the shell's status of a job ended by SIGTERM


def reproducible(policy, sampling):
    """The policy sampled records decode with. A sampled record's tokens depend on the trees its steps verified, and
    tree=auto's follow this machine's timing: sampled regeneration verifies a fixed 5-deep chain instead, so a re-run
    or a resumed run samples the same bytes. Greedy output is the target's whatever the tree: auto stays."""
    if sampling.greedy or not isinstance(policy, AutoPolicy):
        return policy
    log.info("sampled regeneration: tree=auto's shapes follow this machine's timing and a record's samples follow "
             "its shapes, so a fixed chain (tree=chain tree.depth=5) keeps re-runs byte-identical; pass tree=... to "
             "choose another fixed tree")
    return ChainPolicy(5)


@dataclass(frozen=True)
class RegenInput:
    """The input as a run decodes it, read and checked before the model loads."""

    records: list[Record]
    skipped: list[dict]  # the malformed lines skipped (on_error=skip)
    n_shards: int
    t0: float  # when the job started (its wall time includes the loading)


def read_input(cfg: DictConfig) -> RegenInput:
    """``cfg.input``'s records, checked against ``cfg.out_dir``'s manifest and finished shards: a malformed line, a
    run with another input or config, or a corrupt state file is an error before the model loads."""
    t0 = time.time()
    records, skipped = read_records(str(cfg.input), str(cfg.format), str(cfg.on_error))
    if not records:
        raise ValueError(f"{cfg.input} holds no record to regenerate")
    out_dir = Path(cfg.out_dir)
    n_shards = -(-len(records) // int(cfg.shard_size))
    settings = OmegaConf.to_container(cfg, resolve=True)
    check_manifest(out_dir, {"input": str(Path(cfg.input).resolve()), "input_sha1": file_fingerprint(cfg.input),
                             "records": len(records), "shards": n_shards,
                             **{k: settings.get(k) for k in DECODING_KEYS}})
    finished_stats(out_dir, n_shards)  # a corrupt shard's stats: an error now, not after the decoding
    return RegenInput(records, skipped, n_shards, t0)


def treedec_module(cfg: DictConfig, target, tok, draft, policy, sampling):
    """(the Lightning engine's module, the tokenizer, a closer): treedec's speculative decoder."""
    module = SpeculativeGenerationModule(target, draft, policy, sampling, int(cfg.max_new_tokens),
                                         eos_ids=tok.eos_ids or None, seed=int(cfg.seed), compile=bool(cfg.compile),
                                         slots=cfg.get("slots"))
    return module, tok, lambda: None


def vllm_module(cfg: DictConfig, sampling):
    """(the vLLM engine's module, the tokenizer, a closer that stops the engine): the target's config and tokenizer
    only are read here; vLLM loads the weights in its own process (its log: ``<run dir>/vllm.log``)."""
    path = resolve_path(cfg.model.path)
    lc, raw = read_config(path)
    dtype = str(resolve_dtype(cfg.model.dtype, raw)).removeprefix("torch.")
    server = VllmServer(path, dtype, lc.context_length, Path(cfg.paths.run_dir) / "vllm.log",
                        OmegaConf.to_container(cfg.vllm_args, resolve=True), cfg.num_threads)
    tok = load_tokenizer(path)
    module = VllmGenerationModule(server, lc.context_length, sampling, int(cfg.max_new_tokens), tok.eos_ids or None,
                                  int(cfg.seed))
    return module, tok, server.close


def regenerate(cfg: DictConfig, inp: RegenInput, module, tok, close) -> dict:
    """Decode ``inp``'s unfinished shards (this worker's) into ``cfg.out_dir`` with ``module`` (an engine's
    :class:`~treedec.training.predict.GenerationModule`), then ``close()`` it, and return ``metrics.json``."""
    records, skipped, n_shards, t0 = inp.records, inp.skipped, inp.n_shards, inp.t0
    out_dir, S = Path(cfg.out_dir), int(cfg.shard_size)
    renderer = ChatRenderer(tok, cfg.chat_template) if records[0].kind == "chat" else None
    P = int(cfg.prompt_tokens)

    def request(rec: Record):
        return ChatRequest(rec, tok, renderer) if rec.kind == "chat" else TextRequest(rec, tok, P)

    writer = ShardWriter(out_dir, S, bool(cfg.progress))
    data = ShardData(records, out_dir, cfg, writer, request)
    trainer = hydra.utils.instantiate(cfg.trainer, precision="32-true", logger=False, enable_checkpointing=False,
                                      enable_progress_bar=False, use_distributed_sampler=False,
                                      callbacks=[writer, StopOnSigterm()], default_root_dir=str(cfg.paths.run_dir),
                                      _convert_="all")
    try:
        t_run = time.time()
        trainer.predict(module, datamodule=data, return_predictions=False)
        t_run = time.time() - t_run
        done = torch.tensor([writer.done["shards"], writer.done["records"], writer.done["tokens"]])
        done = trainer.strategy.reduce(done, reduce_op="sum")  # every rank's count (DDP); itself on one process
        trainer.strategy.barrier()
    except Preempted:
        log.warning("SIGTERM: stopped after %d shards this run; the finished shards are kept: re-run the same "
                    "command to finish the rest", writer.done["shards"])
        raise SystemExit(SIGTERM_EXIT) from None
    finally:
        data.release()
        close()
    if not trainer.is_global_zero:
        return {}
    wall = time.time() - t0
    shards_run, records_run, tokens_run = (int(x) for x in done.tolist())
    metrics = summarize(out_dir, n_shards, {
        "records_input": len(records) + len(skipped), "skipped_lines": len(skipped), "skipped": skipped,
        "this_run": {"shards": shards_run, "records": records_run, "new_tokens": tokens_run,
                     "decode_time_s": t_run, "world_size": trainer.world_size, "part": int(cfg.part),
                     "parts": int(cfg.parts)},
        "wall_time_s": wall,  # this job, loading included
        "tokens_per_s": tokens_run / t_run if t_run else None,  # this job's new tokens / its trainer.predict time
        "records_per_s": records_run / t_run if t_run else None, "shards_dir": str(out_dir / "shards")})
    tau = "n/a" if metrics["tau"] is None else f"{metrics['tau']:.2f}"
    print(f"{metrics['records']} records in {metrics['shards_done']}/{n_shards} shards ({shards_run} this run), "
          f"{tokens_run} tokens this run, {metrics['tokens_per_s'] or 0:.1f} tok/s, tau {tau}, "
          f"{len(skipped)} lines skipped; train on it: data=jsonl data.path={out_dir / 'shards'}")
    return metrics
