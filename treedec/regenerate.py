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
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf

import treedec.config_schema  # noqa: F401  (registers the structured schema before Hydra composes)
from treedec.atomic import write_text_atomic
from treedec.cli import entry, load_stack, refuse_renamed
from treedec.training.predict import Prompt

log = logging.getLogger(__name__)
DECODING_KEYS = ("model", "draft", "tree", "sampling", "max_new_tokens", "prompt_tokens", "chat_template",
                 "format", "batch_size", "shard_size", "on_error", "seed")  # what a resumed run must share
FREE_KEYS = ("slots",)  # recorded by older runs; free to change (the records are the same)
STATS_KEYS = ("shard", "records", "new_tokens", "row_steps", "step_tokens", "tau")
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


# ---------------------------------------------------------------------------------------- shards
def shard_path(out_dir: Path, k: int, suffix: str = ".jsonl") -> Path:
    return out_dir / "shards" / f"part-{k:05d}{suffix}"


@contextlib.contextmanager
def state_lock(out_dir: Path) -> Iterator[None]:
    """``<out_dir>/.state.lock`` held (flock) for the block: one job at a time checks and writes the shared
    ``manifest.json`` and ``metrics.json`` (jobs of a SLURM array start together)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".state.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read_state(path: Path, fix: str, keys: tuple[str, ...] = ()) -> dict | None:
    """A JSON object ``out_dir`` keeps (the manifest, a shard's stats); None when absent. One that does not
    read as an object holding ``keys`` is an error naming the file and ``fix``."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        obj = json.loads(data)
        problem = None if isinstance(obj, dict) else f"a JSON {type(obj).__name__}, not an object"
    except (ValueError, RecursionError) as exc:
        problem = f"not valid JSON: {exc}"
    if problem is None and (missing := [k for k in keys if k not in obj]):
        problem = f"no {', '.join(missing)}"
    if problem is not None:
        raise ValueError(f"{path} is corrupt ({problem}); {fix}")
    return obj


def comparable(manifest: dict) -> dict:
    """A manifest as resumes compare it: the kernel (``model.attn_backend``) as its own key, the keys free to
    change (``FREE_KEYS``) left out; older manifests (kernel inside ``model``, ``slots``) read the same."""
    out = {k: v for k, v in manifest.items() if k not in FREE_KEYS}
    if isinstance(out.get("model"), dict) and "attn_backend" in out["model"]:
        out["model"] = dict(out["model"])
        out.setdefault("kernel", out["model"].pop("attn_backend"))
    return out


def check_manifest(out_dir: Path, manifest: dict) -> None:
    """Write ``manifest.json`` on a fresh output dir; refuse one that holds another input or decoding config.
    Checked and written under :func:`state_lock`, so two jobs starting at once cannot both write theirs."""
    path = out_dir / "manifest.json"
    with state_lock(out_dir):
        old = read_state(path, f"it records what {out_dir} regenerates: delete it to resume with the settings "
                               f"of this command, or pick a new out_dir / hydra.run.dir")
        if old is None:
            write_text_atomic(path, json.dumps(comparable(manifest), indent=2) + "\n")
            return
        old, new = comparable(old), comparable(manifest)
        if old != new:
            diff = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
            raise ValueError(f"{out_dir} holds a regeneration of another input or config (differs in: "
                             f"{', '.join(diff)}); re-run with the same settings to resume it, or pick a new "
                             f"out_dir / hydra.run.dir")


class ShardWriter(L.Callback):
    """Buffers a rank's finished records per shard and writes each shard once complete (its stats, then its
    records: temp + rename each); draws the progress bar (records/s, tokens/s, τ) and logs τ per shard."""

    def __init__(self, out_dir: Path, shard_size: int, progress: bool):
        self.out_dir, self.shard_size, self.progress = out_dir, shard_size, progress
        self.sizes: dict[int, int] = {}
        self.buffers: dict[int, list] = {}
        self.stats: dict[int, object] = {}
        self.seconds: dict[int, float] = {}
        self.done = {"shards": 0, "records": 0, "tokens": 0}
        self.bar = None

    def start(self, sizes: dict[int, int], show: bool) -> None:
        from tqdm.auto import tqdm

        self.sizes, self.t0 = sizes, time.perf_counter()
        self.bar = tqdm(total=sum(sizes.values()), unit="rec", disable=not (self.progress and show), desc="regenerate")

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        k = outputs["requests"][0].rec.index // self.shard_size
        self.buffers.setdefault(k, []).extend(outputs["requests"])
        self.stats[k] = outputs["stats"] if k not in self.stats else self.stats[k].merge(outputs["stats"])
        self.seconds[k] = self.seconds.get(k, 0.0) + outputs["seconds"]
        self.done["tokens"] += outputs["stats"].new_tokens
        self.bar.update(len(outputs["requests"]))
        rate = self.done["tokens"] / max(time.perf_counter() - self.t0, 1e-9)
        self.bar.set_postfix_str(f"{rate:.0f} tok/s, tau {outputs['stats'].tau:.2f}")
        if len(self.buffers[k]) == self.sizes[k]:
            self.write(k)

    def on_predict_end(self, trainer, module) -> None:
        if self.bar is not None:
            self.bar.close()

    def write(self, k: int) -> None:
        reqs = sorted(self.buffers.pop(k), key=lambda r: r.rec.index)
        st, secs = self.stats.pop(k), self.seconds.pop(k)
        stats = {"shard": k, "records": len(reqs), "new_tokens": st.new_tokens, "row_steps": st.row_steps,
                 "step_tokens": st.step_tokens, "tau": st.tau, "seconds": secs,
                 "tokens_per_s": st.new_tokens / secs if secs else None, "ids": [r.rec.id for r in reqs]}
        write_text_atomic(shard_path(self.out_dir, k, ".stats.json"), json.dumps(stats) + "\n")
        text = "".join(json.dumps(r.output(), ensure_ascii=False) + "\n" for r in reqs)
        write_text_atomic(shard_path(self.out_dir, k), text)  # last: the shard's "done" mark
        self.done["shards"] += 1
        self.done["records"] += len(reqs)
        log.info("shard %d: %d records, %d tokens, tau %.2f, %.1f tok/s", k, len(reqs), st.new_tokens, st.tau,
                 stats["tokens_per_s"] or 0.0)


class Preempted(Exception):
    """Raised at a batch boundary once the job got SIGTERM: it stops, its finished shards kept."""


class StopOnSigterm(L.Callback):
    """SIGTERM (a preemption, a time limit, ``kill``) stops the job after the batch it is decoding (listed after
    the :class:`ShardWriter`, which writes a shard that batch finished first). Lightning's own handler only sets a
    flag that its predict loop never reads (and, under DDP, broadcasts from inside the handler); this one, set for
    the predict loop (Lightning restores the handler of before when it ends), forwards the signal to the DDP
    processes Lightning started and raises :class:`Preempted` at the next batch end."""

    def __init__(self):
        self.signalled, self.trainer = False, None

    def on_predict_start(self, trainer, module) -> None:
        self.trainer, self.signalled = trainer, bool(getattr(trainer, "received_sigterm", False))
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        launcher = self.trainer.strategy.launcher
        if not self.signalled and launcher is not None and hasattr(launcher, "kill"):
            launcher.kill(signum)  # the ranks Lightning started (none under srun: SLURM signals each task)
        self.signalled = True

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.signalled:
            raise Preempted()


class ShardData(L.LightningDataModule):
    """A rank's unfinished shards, in batches that never straddle a shard; the split is decided in
    ``predict_dataloader``, once Lightning knows the ranks. Holds the worker's claim while it runs."""

    def __init__(self, records: list[Record], out_dir: Path, cfg: DictConfig, writer: ShardWriter, request):
        super().__init__()
        self.records, self.out_dir, self.cfg, self.writer, self.request = records, out_dir, cfg, writer, request
        self.lock = None
        self.allow_zero_length_dataloader_with_multiple_devices = True  # a rank may have no shard (it idles)

    def predict_dataloader(self):
        import torch

        from treedec.training.run_dir import RunDirLock

        cfg, S, B = self.cfg, int(self.cfg.shard_size), int(self.cfg.batch_size)
        rank, world = self.trainer.global_rank, self.trainer.world_size
        W, w = int(cfg.parts) * world, int(cfg.part) * world + rank
        claim = self.out_dir / ".claims" / f"worker-{w}-of-{W}"
        claim.mkdir(parents=True, exist_ok=True)
        self.lock = RunDirLock(claim).acquire()  # a second copy of this worker is refused
        mine = {k: self.records[k * S:(k + 1) * S] for k in range(w, -(-len(self.records) // S), W)}
        todo = {k: recs for k, recs in mine.items() if not shard_done(self.out_dir, k, len(recs))}
        for k in todo:  # temp files a killed run left behind (this worker's shards only: others may be writing)
            for tmp in shard_path(self.out_dir, k).parent.glob(f".part-{k:05d}.*.tmp"):
                tmp.unlink(missing_ok=True)
            if shard_path(self.out_dir, k).is_file():
                log.warning("shard %d has no stats or not its %d records: decoding it again", k, len(todo[k]))
        log.info("worker %d of %d: %d shards, %d finished before, %d to do", w, W, len(mine), len(mine) - len(todo),
                 len(todo))
        self.writer.start({k: len(v) for k, v in todo.items()}, show=rank == 0)
        batches = [[self.request(r) for r in recs[i:i + B]] for recs in todo.values() for i in range(0, len(recs), B)]
        return torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=lambda b: b)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def shard_done(out_dir: Path, k: int, n: int) -> bool:
    """Shard k is complete: its stats are there and its file (renamed into place whole, after them) holds its
    n records. A shard without its stats is not (its metrics would be missing forever): it is decoded again."""
    p = shard_path(out_dir, k)
    return shard_path(out_dir, k, ".stats.json").is_file() and p.is_file() and sum(1 for _ in p.open("rb")) == n


def shard_stats(out_dir: Path, k: int) -> dict | None:
    """The stats of shard k when it is finished (its file and its stats are there), else None."""
    if not shard_path(out_dir, k).is_file():
        return None
    return read_state(shard_path(out_dir, k, ".stats.json"), "delete it and re-run the same command: that shard "
                      "is decoded again", STATS_KEYS)


def finished_stats(out_dir: Path, n_shards: int) -> list[dict]:
    """The stats of every finished shard in ``out_dir`` (all ranks, all jobs); a corrupt one is an error."""
    return [st for k in range(n_shards) if (st := shard_stats(out_dir, k)) is not None]


def summarize(out_dir: Path, n_shards: int, extra: dict) -> dict:
    """``metrics.json`` over every finished shard in ``out_dir`` (all ranks, all jobs), written under a lock."""
    with state_lock(out_dir):
        shards = finished_stats(out_dir, n_shards)
        rows, toks = sum(s["row_steps"] for s in shards), sum(s["step_tokens"] for s in shards)
        metrics = {"records": sum(s["records"] for s in shards), "new_tokens": sum(s["new_tokens"] for s in shards),
                   "tau": toks / rows if rows else None, "shards_done": len(shards), "shards": n_shards,
                   "complete": len(shards) == n_shards,
                   "tau_per_shard": {int(s["shard"]): s["tau"] for s in shards}, **extra}
        write_text_atomic(out_dir / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    return metrics


# ------------------------------------------------------------------------------------------- run
def run(cfg: DictConfig) -> dict:
    """Regenerate ``cfg.input`` into ``cfg.out_dir``; every option is checked before the model loads."""
    from treedec.config_checks import instantiate_checked, validate

    validate(cfg, "regenerate")
    policy = instantiate_checked(cfg.tree, "tree")
    sampling = instantiate_checked(cfg.sampling, "sampling")
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
    refuse_renamed("regenerate")
    main()
