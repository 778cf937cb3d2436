"""The probe run: speculative decoding with a wide probe tree, recording which sibling ranks each step tried and
which it accepted (the Sequoia model's rates) and every verified edge's outcome (the draft calibration's bins)."""
from __future__ import annotations

import torch

from treedec.decoding.speculative import SpeculativeDecoder
from treedec.sampling import target_probs
from treedec.tree.calibration import Calibration, Reliability, fit, fit_power
from treedec.tree.sequoia import AcceptanceCounts


def edge_labels(step, sampling):
    """One step's edges -> (draft log-prob, acceptance label, child depth, tried), all [B, T] on the device.

    An edge is *tried* when its parent is on the accepted path (the target's choice there is real).
    Its label is the target's processed probability of the child at the parent (greedy: 1 for the
    argmax, else 0): the chance the acceptance rule takes that edge, given the parent was accepted.
    """
    tree = step.tree
    B, T = tree.tokens.shape
    par = tree.parents.expand(B, T).clamp(min=0)
    depth = tree.depth.expand(B, T)
    logq = tree.scores - tree.scores.gather(1, par)
    n = torch.tensor(step.n_accept, device=par.device)
    path = step.path
    on_path = torch.zeros(B, T, dtype=torch.bool, device=par.device)
    on_path.scatter_(1, torch.where(torch.arange(path.shape[1], device=par.device) < n[:, None], path, 0), True)
    on_path &= (n > 0)[:, None]
    tried = on_path.gather(1, par) & (depth > 0)
    probs = target_probs(step.logits, sampling)  # [B, T, V]
    rows = torch.arange(B, device=par.device)[:, None]
    label = probs[rows, par, tree.tokens]
    return logq, label, depth, tried


def probe_acceptance(target, draft, probe, sampling, prompts, max_new_tokens: int, eos_ids, seed: int, stream=None):
    """Run speculative decoding with ``probe`` on each prompt -> (AcceptanceCounts, merged stats dict, Reliability)."""
    counts = AcceptanceCounts()
    reliability = Reliability(probe.max_depth, target.device)

    def record(step) -> None:  # the decoder's per-step hook: what each row's walk tried, and every edge's outcome
        for b, on in enumerate(step.active):
            if on:
                counts.add(step.tried_ranks(b))
        if step.tree is not None and step.tree.scores is not None:
            reliability.add(*edge_labels(step, sampling))

    dec = SpeculativeDecoder(target, draft, probe, sampling, eos_ids=eos_ids)
    total = None
    for i, ids in enumerate(prompts):
        gen = torch.Generator(device=target.device).manual_seed(seed + i)
        s = dec.generate([ids], max_new_tokens, generator=gen, stream=stream, hook=record, timing=True).stats
        total = s if total is None else total.merge(s)
    return counts, total.as_dict(), reliability


def fit_calibration(reliability, sampling, prior_strength: float, meta: dict, map: str = "power"):
    """The per-depth power and isotonic maps of a probe run -> (Calibration applying ``map``, the measured bins)."""
    conf, label, count = reliability.result()
    values = fit(conf, label, count, prior_strength=prior_strength)
    power = fit_power(conf, label, count, prior_strength=prior_strength)
    greedy = bool(sampling.greedy)
    mode = {"rule": "greedy" if greedy else "sampling",
            "acceptance": "target argmax == child" if greedy else "target processed probability of the child",
            **({} if greedy else {"temperature": float(sampling.temperature), "top_k": int(sampling.top_k),
                                  "top_p": float(sampling.top_p)}),
            "draft_temperature": 1.0}
    bins = {"conf_sum": conf, "accept_sum": label, "count": count}
    meta = {**meta, "mode": mode, "trials_by_depth": [int(sum(c)) for c in count]}
    return Calibration(values, meta=meta, power=power, map=map), bins
