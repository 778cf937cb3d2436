"""Learn a tree shape: ``python -m treedec.calibrate [hydra overrides]``.

1. **Probe**: speculative decoding with a wide probe tree (default: a "comb", see
   :func:`treedec.tree.sequoia.comb_choices`) on calibration prompts (held-out stdlib code,
   code of installed third-party packages, or a prompt file: treedec/data/prompts.py) records,
   for every verified node with children, which sibling ranks were tried
   and which was accepted, by depth: the acceptance rates ``p[depth][rank]`` of the Sequoia
   model (DecodeStats' ``rank_hits / rank_trials``, split by depth).
2. **Timing** (``timing.enabled``): the median target verify pass for trees of each budget on
   this machine, with ``timing.prefix_len`` tokens in the KV cache, and the median draft-head
   step (one tree level).
3. **DP**: :func:`treedec.tree.sequoia.solve` gives the tree of every budget and depth limit that
   maximises the expected accepted length; :func:`~treedec.tree.sequoia.choose` picks the budget
   and depth with the most expected tokens/s (or the fixed ``dp.budget`` / ``dp.depth``).
4. **Calibration**: every edge the probe verified whose parent was accepted is binned by its draft
   probability and depth with its outcome (greedy: argmax match; sampling: the target's processed
   probability of the child); per-depth power and isotonic maps (tree/calibration.py) are fitted and written
   as ``calibration.yaml`` beside the shape file (``tree=dynamic tree.calibration=...``), with a
   reliability diagram ``reliability.png`` (and its bins, ``reliability.json``) in the run dir.
5. **Output**: the shape file ``out`` (default ``<run dir>/learned_tree.yaml``; use it with
   ``tree=learned tree.path=...``), ``acceptance.json`` and ``metrics.json`` in the run dir.

A one-pass head (P-EAGLE, DFlash) drafts best-first trees of its per-depth marginals, not a learned shape: its probe
is a best-first tree of ``dp.max_budget`` nodes as deep as its block, and the run writes only the calibration
(step 4), which ``tree=best_first`` and ``tree=auto`` read beside the head.

The work is :mod:`treedec.probe`'s, imported inside :func:`run` once the options are checked: it loads torch and
the decoders, seconds of imports a mistyped option must not wait for before its one-line error.
"""
from __future__ import annotations

import logging
import time

import hydra
from omegaconf import DictConfig

import treedec.config.schema  # noqa: F401  (registers schema/calibrate before Hydra composes)
from treedec.cli import entry, launch, load_stack

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> dict:
    """Probe, time, solve and write the learned tree; every option is checked before the model loads."""
    from treedec.config import instantiate_checked, validate

    validate(cfg, "calibrate")  # also the probe node by its _target_, before anything loads
    import torch  # (after the checks: see the module docstring)

    from treedec.probe.acceptance import probe_acceptance
    from treedec.probe.learn import learn_tree
    from treedec.probe.outputs import summary, write_one_pass_outputs, write_outputs
    from treedec.probe.prompts import encode_prompts, prompt_set
    from treedec.tree.policies import BestFirstPolicy

    probe = instantiate_checked(cfg.probe, "probe")
    if hasattr(probe, "scores"):  # a static probe records its nodes' draft log-probs for the reliability diagram
        probe.scores = True
    sampling = instantiate_checked(cfg.sampling, "sampling")
    if cfg.num_threads:
        torch.set_num_threads(int(cfg.num_threads))
    torch.manual_seed(int(cfg.seed))
    t_start = time.perf_counter()
    target, tok, draft = load_stack(cfg)
    one_pass = getattr(draft, "one_pass", False)
    if one_pass:  # the best paths of its raw marginals, as deep as its block
        probe = BestFirstPolicy(int(cfg.dp.max_budget), draft.block_size, calibration=None)
    pset = prompt_set(cfg, tok)
    prompts = encode_prompts(cfg, tok, [p.text for p in pset])
    log.info("probing acceptance: %d prompts x %d new tokens, probe tree of %d nodes (depth %d)",
             len(prompts), cfg.max_new_tokens, probe.max_size, probe.max_depth)
    counts, probe_stats, reliability = probe_acceptance(target, draft, probe, sampling, prompts, int(cfg.max_new_tokens),
                                                        tok.eos_ids or None, int(cfg.seed))
    if not counts.trials:
        raise RuntimeError("the probe run verified no node with children; raise max_new_tokens or check the probe")
    if one_pass:
        metrics = write_one_pass_outputs(cfg, target, sampling, pset, probe_stats, reliability, t_start)
        print(summary(metrics))
        return metrics
    learned = learn_tree(counts, probe_stats, cfg.dp, cfg.timing, target, draft)
    metrics = write_outputs(cfg, target, sampling, pset, counts, probe_stats, reliability, learned, t_start)
    print(summary(metrics))
    return metrics


@hydra.main(version_base="1.3", config_path="pkg://treedec.conf", config_name="calibrate")
@entry
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    launch("calibrate", main)
