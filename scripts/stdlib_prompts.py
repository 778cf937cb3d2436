"""Write ``{"text": ...}`` prompt records cut from the stdlib's *train* split, the input of
``python -m treedec.regenerate`` when a head is to learn the bundled target's own continuations.

    python scripts/stdlib_prompts.py /tmp/stdlib_prompts.jsonl --every 1500

Each record starts at a line boundary about every ``--every`` characters of a file and holds
``--chars`` characters (regenerate keeps its first ``prompt_tokens`` tokens as the prompt). Only
train-split files are read (``treedec.data.corpus.split_files``), so validation files and the bench's
third-party prompts stay unseen. The output is written to a temporary file and renamed into place;
an existing file is refused.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from treedec.data.corpus import read_source, split_files, stdlib_root


def windows(text: str, every: int, chars: int, rng: random.Random) -> list[str]:
    """Slices of ``chars`` characters starting at line starts, about one per ``every`` characters."""
    starts = [0] + [i + 1 for i, c in enumerate(text) if c == "\n"]
    n = max(1, len(text) // every)
    picked = sorted(rng.sample(starts, min(n, len(starts))))
    return [s for s in (text[i:i + chars] for i in picked) if len(s.strip()) >= chars // 4]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the .jsonl to create")
    ap.add_argument("--every", type=int, default=3000, help="characters of source per record")
    ap.add_argument("--chars", type=int, default=600, help="characters per record")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", help="the corpus root (default: this Python's stdlib)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if out.exists():
        raise SystemExit(f"Error: {out} exists; choose another path or remove it first")
    rng, root, n = random.Random(args.seed), Path(args.root) if args.root else stdlib_root(), 0
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        for rel in split_files(root, "train"):
            for w in windows(read_source(root, rel), args.every, args.chars, rng):
                f.write(json.dumps({"text": w, "source": rel}) + "\n")
                n += 1
    os.replace(tmp, out)
    print(f"{n} records from the stdlib's train split -> {out}")


if __name__ == "__main__":
    main()
