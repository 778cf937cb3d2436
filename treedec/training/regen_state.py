"""The on-disk state of ``python -m treedec.regenerate``: its shards (``shards/part-<k>.jsonl`` and their stats),
``manifest.json`` (what a resumed run must share), the ``.state.lock`` around it, the per-worker claims, the
shard writer, the SIGTERM stop, and the ``metrics.json`` summary of the finished shards."""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import signal
import time
from pathlib import Path
from typing import Iterator, Sequence

import lightning as L
import torch
from omegaconf import DictConfig
from tqdm.auto import tqdm

from treedec.atomic import write_text_atomic
from treedec.training.run_dir import RunDirLock

log = logging.getLogger("treedec.regenerate")
FREE_KEYS = ("slots",)  # recorded by older runs; free to change (the records are the same)
STATS_KEYS = ("shard", "records", "new_tokens", "row_steps", "step_tokens", "tau")


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
    change (``FREE_KEYS``) left out; older manifests (kernel inside ``model``, ``slots``, no ``engine``) read the
    same."""
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
        for m in (old, new):
            m.setdefault("engine", "lightning")  # (older runs: the only engine there was)
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

    def __init__(self, records: Sequence, out_dir: Path, cfg: DictConfig, writer: ShardWriter, request):
        super().__init__()
        self.records, self.out_dir, self.cfg, self.writer, self.request = records, out_dir, cfg, writer, request
        self.lock = None
        self.allow_zero_length_dataloader_with_multiple_devices = True  # a rank may have no shard (it idles)

    def predict_dataloader(self):
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
