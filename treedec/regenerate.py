"""Regenerate training data with the target: ``python -m treedec.regenerate input=records.jsonl [overrides]``.

EAGLE heads train best on what the target itself says. This reads a JSON-lines file in the formats
``data=jsonl`` reads and writes the same format back with the target's own text, decoded
speculatively by :class:`treedec.training.predict.SpeculativeGenerationModule` under
``trainer.predict``:

* ``{"text": ...}``: the first ``prompt_tokens`` tokens are the prompt, cut back to whole characters
  (only a prefix of a long text is tokenized); the record's text becomes the prompt plus the target's
  continuation (up to ``max_new_tokens``, or its EOS). Text is text: a special token's string in it
  (``"<|endoftext|>"``) is encoded as plain characters, never as the token;
* chats (ShareGPT ``conversations`` / ``from``-``value``, or ``messages`` / ``role``-``content``):
  every assistant turn is regenerated in order, given the conversation so far (earlier replies
  already regenerated) rendered with the chat template that ``data=jsonl`` trains with.

Every other key of a record is kept, and its ``id`` (its line number where it has none).

**Sampling** (``sampling=sample``): each record draws from its own random stream, seeded by
(``seed``, the record's line number in the input, the assistant turn): records that share an ``id``
(or have ``"id": null``) still get their own samples, and a re-run, a resume or any split across
processes gives the same samples.

**Shards.** Records are cut, in input order, into shards of ``shard_size``; shard k is written to
``<out_dir>/shards/part-<k>.jsonl`` through a temp file and a rename, after its stats
(``part-<k>.stats.json``): a shard is there complete or not at all, and is finished when both files
are (one without its stats is decoded again). A re-run into the same ``out_dir`` (after a crash,
``kill -9`` or a SIGTERM) skips finished shards; ``manifest.json`` refuses a re-run with another input
or decoding config, naming the keys that differ (``kernel`` for the attention kernel; ``slots`` may
change, it does not change the records). A corrupt state file is an error naming it and the fix.
``data.path=<out_dir>/shards`` trains on the result as is.

**Preemption.** On SIGTERM (SLURM preemption or time limit, ``kill``) the job stops after the batch it
is decoding, keeps every finished shard, and exits with status 143 (128 + SIGTERM); the same command
finishes the rest, with the records an uninterrupted run writes.

**Many processes.** Shard k belongs to worker ``k % W``, with W = ``parts`` × DDP world size and
worker = ``part`` × world size + rank: ``trainer=ddp`` splits the shards across ranks and a SLURM
array (``-m hydra/launcher=slurm part=range(N) parts=N out_dir=<shared dir>``) across jobs. Batches
never straddle shards and rows are seeded by line number, so the union of the outputs is the output
of one process; a rank left without a shard waits for the others and ends cleanly. A worker holds
``.claims/worker-<w>-of-<W>/.lock`` while it runs (a second copy of the same worker is refused);
``manifest.json`` is checked and written, and ``metrics.json`` rewritten by every job that ends, under
``<out_dir>/.state.lock``.

A malformed line (not JSON, nested too deeply, a lone surrogate, a wrong shape) is an error naming its
line, before the model loads, or, with ``on_error=skip``, skipped, logged and counted in ``metrics.json``.

The shards, the manifest, the locks and claims and the stats files: :mod:`treedec.regenerate_state`.
"""
from __future__ import annotations

import copy
import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import treedec.config.schema  # noqa: F401  (registers the structured schema before Hydra composes)
from treedec.cli import entry, launch, load_stack
from treedec.regenerate_state import (Preempted, ShardData, ShardWriter, StopOnSigterm, check_manifest,
                                      finished_stats, summarize)
from treedec.training.predict import Prompt

log = logging.getLogger(__name__)
DECODING_KEYS = ("model", "draft", "tree", "sampling", "max_new_tokens", "prompt_tokens", "chat_template",
                 "format", "batch_size", "shard_size", "on_error", "seed")  # what a resumed run must share
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143: the shell's status of a job ended by SIGTERM


# --------------------------------------------------------------------------------------- records
@dataclass
class Record:
    index: int  # position among the kept records (decides the shard)
    line: int
    obj: dict
    kind: str  # text | chat
    payload: object  # the text, or [{"role", "content"}, ...]

    @property
    def id(self):
        return self.obj.get("id", self.line)


def read_records(path: str, fmt: str = "auto", on_error: str = "fail") -> tuple[list[Record], list[dict]]:
    """The input's records and the malformed lines skipped (``[{"line", "error"}]``; only with on_error=skip)."""
    from treedec.data.corpus import read_jsonl

    errors: list = [] if on_error == "skip" else None
    records, kind = [], None if fmt == "auto" else fmt
    try:
        for line, raw, k, payload in read_jsonl(path, errors):
            where = f"{path}:{line}"
            problem = None
            if k != (kind := kind or k):
                problem = f"{where}: a {k} line in a {kind} file; one file holds one kind (text or chat)"
            elif k == "text" and not payload.strip():
                problem = f"{where}: the text is empty: there is no prompt to continue"
            elif k == "chat" and not any(m["role"] == "assistant" for m in payload):
                problem = f"{where}: the conversation has no assistant turn to regenerate"
            if problem is None:
                records.append(Record(len(records), line, json.loads(raw), k, payload))
            elif errors is None:
                raise ValueError(problem)
            else:
                errors.append((line, problem))
    except ValueError as exc:
        raise ValueError(f"{exc}. Fix the line, or pass on_error=skip to skip malformed lines") from None
    skipped = [{"line": n, "error": msg} for n, msg in sorted(errors or [])]
    for s in skipped:
        log.warning("skipping line %d: %s", s["line"], s["error"])
    return records, skipped


class TextRequest(Prompt):
    """A text record: its first ``prompt_tokens`` tokens (whole characters), continued once; its random stream
    is keyed by its line number (ids repeat, or are null)."""

    def __init__(self, rec: Record, tok, prompt_tokens: int):
        super().__init__(rec.line, tok.encode_head(rec.payload, prompt_tokens))
        self.rec, self.tok = rec, tok

    def output(self) -> dict:
        text = self.tok.decode(self.ids + _continuation(self.tokens, self.tok))
        return {**self.rec.obj, "id": self.rec.id, "text": text}


class ChatRequest:
    """A chat record: each assistant turn in order, the earlier ones already the target's."""

    def __init__(self, rec: Record, tok, renderer):
        self.rec, self.tok, self.renderer, self.key = rec, tok, renderer, rec.line  # (the random stream's key)
        self.messages = [dict(m) for m in rec.payload]
        self.todo = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]

    def next_prompt(self) -> list[int] | None:
        if not self.todo:
            return None
        return self.tok.encode(self.renderer.render(self.messages[:self.todo[0]], add_generation_prompt=True),
                               add_bos=False, specials=True)  # the template's special tokens

    def take(self, tokens: list[int]) -> None:
        self.messages[self.todo.pop(0)]["content"] = self.tok.decode(_continuation(tokens, self.tok))

    def output(self) -> dict:
        obj = copy.deepcopy(self.rec.obj)
        turns = obj["conversations"] if "conversations" in obj else obj["messages"]
        for turn, m in zip(turns, self.messages):  # the record's own keys (value / content) keep their names
            turn["value" if "value" in turn else "content"] = m["content"]
        return {**obj, "id": self.rec.id}


def _continuation(tokens: list[int], tok) -> list[int]:
    """The target's tokens without their EOS, and without a character the budget cut short (no U+FFFD)."""
    return tok.whole_chars(tokens[:-1] if tokens and tokens[-1] in set(tok.eos_ids) else tokens)




# ------------------------------------------------------------------------------------------- run
def reproducible(policy, sampling):
    """The policy sampled records decode with. A sampled record's tokens depend on the trees its steps verified, and
    tree=auto's follow this machine's timing: sampled regeneration verifies a fixed 5-deep chain instead, so a re-run
    or a resumed run samples the same bytes. Greedy output is the target's whatever the tree: auto stays."""
    from treedec.tree.policies import AutoPolicy, ChainPolicy

    if sampling.greedy or not isinstance(policy, AutoPolicy):
        return policy
    log.info("sampled regeneration: tree=auto's shapes follow this machine's timing and a record's samples follow "
             "its shapes, so a fixed chain (tree=chain tree.depth=5) keeps re-runs byte-identical; pass tree=... to "
             "choose another fixed tree")
    return ChainPolicy(5)


def run(cfg: DictConfig) -> dict:
    """Regenerate ``cfg.input`` into ``cfg.out_dir``; every option is checked before the model loads."""
    from treedec.config_checks import instantiate_checked, validate

    validate(cfg, "regenerate")
    policy = instantiate_checked(cfg.tree, "tree")
    sampling = instantiate_checked(cfg.sampling, "sampling")
    policy = reproducible(policy, sampling)
    t0 = time.time()
    records, skipped = read_records(str(cfg.input), str(cfg.format), str(cfg.on_error))
    if not records:
        raise ValueError(f"{cfg.input} holds no record to regenerate")
    out_dir, S = Path(cfg.out_dir), int(cfg.shard_size)
    n_shards = -(-len(records) // S)
    from treedec.data.files import file_fingerprint

    settings = OmegaConf.to_container(cfg, resolve=True)
    check_manifest(out_dir, {"input": str(Path(cfg.input).resolve()), "input_sha1": file_fingerprint(cfg.input),
                             "records": len(records), "shards": n_shards,
                             **{k: settings.get(k) for k in DECODING_KEYS}})
    finished_stats(out_dir, n_shards)  # a corrupt shard's stats: an error now, not after the decoding

    import torch

    from treedec.data.chat import ChatRenderer
    from treedec.training.predict import SpeculativeGenerationModule

    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    target, tok, draft = load_stack(cfg)
    module = SpeculativeGenerationModule(target, draft, policy, sampling, int(cfg.max_new_tokens),
                                         eos_ids=tok.eos_ids or None, seed=int(cfg.seed), compile=bool(cfg.compile),
                                         slots=cfg.get("slots"))
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


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="regenerate")
@entry
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    launch("regenerate", main)
