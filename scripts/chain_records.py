"""How well the auto budget's counterfactual chain records match what each chain accepts when played.

    python scripts/chain_records.py --batch 16 --played 7 --chains 3,4,5,6
    python scripts/chain_records.py --batch 1 --played 10 --chains 7,8,9

Decodes the third-party prompts with a fixed ``--played``-deep chain and records each live row's run r (drafts
accepted) per step; then decodes with each shallower chain and measures its own τ. From the played chain's runs a
d-deep chain's record is estimated three ways: one play a row and step (min(r, d)), every step the shallower chain
would take over the text a long run covered ((r + 1) / (d + 1) plays where r >= d), and halfway between
(``BudgetController.stretch`` = 0.5, what the budget records). Bundled model, bf16 target, ragged static batches.
"""
from __future__ import annotations

import argparse

import torch


def record_tau(runs: list[int], d: int, stretch: float) -> float:
    """τ (1 + accepted drafts per row and step) of a d-deep chain as the budget records it from a deeper chain's
    per-row runs (:func:`treedec.tree.budget.covered_plays` weights, ``stretch`` as ``BudgetController.stretch``)."""
    from treedec.tree.budget import covered_plays

    w = [covered_plays(r, d, stretch) for r in runs]
    return 1.0 + sum(x * min(r, d) for x, r in zip(w, runs)) / sum(w)


def main() -> None:
    from treedec.data.prompts import load_prompt_set
    from treedec.models import load_model
    from treedec.models.draft import DraftHead
    from treedec.models.tokenizer import load_tokenizer
    from treedec.training.predict import CompactingDecoder
    from treedec.tree.policies import ChainPolicy

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--played", type=int, default=10, help="depth of the chain whose steps the records are taken on")
    ap.add_argument("--chains", default="7,8,9", help="shallower chain depths to compare, comma-separated")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = load_tokenizer("tiny-code")
    prompts = [tok.encode(p.text) for p in load_prompt_set("third_party", a.prompts, 128, tok, seed=0)]
    target = load_model("tiny-code", dtype=torch.bfloat16)
    head = DraftHead.load("tiny-code-eagle", target=target, dtype="auto")

    def runs_of(depth: int) -> list[int]:
        dec, out = CompactingDecoder(target, head, ChainPolicy(depth)), []
        hook = lambda info: out.extend(k - 1 for k, live in zip(info.n_accept, info.active) if live)  # noqa: E731
        for i in range(0, len(prompts), a.batch):
            dec.generate(prompts[i:i + a.batch], a.tokens, hook=hook)
        return out

    runs = runs_of(a.played)
    print(f"played chain {a.played}, batch {a.batch}: {len(runs)} row-steps, τ {1 + sum(runs) / len(runs):.3f}, "
          f"all drafts accepted on {sum(r == a.played for r in runs) / len(runs):.1%}")
    print("chain | own τ | one play a step | covered text | halfway (kept)")
    for d in map(int, a.chains.split(",")):
        own = runs_of(d)
        print(f"{d:5d} | {1 + sum(own) / len(own):.3f} | " +
              " | ".join(f"{record_tau(runs, d, s):.3f}" for s in (0.0, 1.0, 0.5)))


if __name__ == "__main__":
    main()
