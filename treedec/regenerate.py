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

**Engines.** ``engine=lightning`` (the default) decodes with treedec's speculative decoder; ``engine=vllm``
(``make vllm``) with vLLM's own, one engine in a child process for the whole job (``vllm_args``: more arguments of
``vllm.LLM``, e.g. ``+vllm_args.tensor_parallel_size=2``), for corpora that outgrow one machine's treedec: the
same shards, manifest, resume and parts; greedy fp32 shards equal the Lightning engine's (docs/regenerate.md).

The job: :mod:`treedec.training.regenerate_job` (the records and requests: :mod:`treedec.training.regen_requests`;
the shards, the manifest, the locks and claims and the stats files: :mod:`treedec.training.regen_state`), imported
inside :func:`run` once the options are checked: torch and Lightning take seconds to import, and a mistyped option
must end in its one-line error before they load.
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

import treedec.config.schema  # noqa: F401  (registers the structured schema before Hydra composes)
from treedec.cli import entry, launch, load_stack


def run(cfg: DictConfig) -> dict:
    """Regenerate ``cfg.input`` into ``cfg.out_dir``; every option is checked before the model loads."""
    from treedec.config import instantiate_checked, validate

    validate(cfg, "regenerate")
    policy = instantiate_checked(cfg.tree, "tree")
    sampling = instantiate_checked(cfg.sampling, "sampling")
    import torch  # (after the checks: see the module docstring)

    from treedec.training.regenerate_job import read_input, regenerate, reproducible, treedec_module, vllm_module

    policy = reproducible(policy, sampling)
    inp = read_input(cfg)  # a malformed line, or an out_dir of another run: an error before the model loads
    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    if cfg.engine == "vllm":  # vLLM loads the target itself, in its own process: treedec reads its config only
        return regenerate(cfg, inp, *vllm_module(cfg, sampling))
    target, tok, draft = load_stack(cfg)
    return regenerate(cfg, inp, *treedec_module(cfg, target, tok, draft, policy, sampling))


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="regenerate")
@entry
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    launch("regenerate", main)
