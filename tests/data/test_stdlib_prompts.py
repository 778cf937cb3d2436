"""scripts/stdlib_prompts.py: regenerate's input for the bundled head, from the train split only."""
import json
import random

import pytest

from scripts.stdlib_prompts import main, windows
from treedec.data.corpus import split_of


def test_windows_start_at_lines_and_keep_their_length():
    text = "".join(f"line {i} " + "x" * 40 + "\n" for i in range(200))
    got = windows(text, every=1000, chars=120, rng=random.Random(0))
    assert 5 <= len(got) <= len(text) // 1000  # one per 1000 characters; a start too near the end is dropped
    assert all(w.startswith("line ") and 30 <= len(w) <= 120 for w in got)


def test_reads_the_train_split_only_and_refuses_to_overwrite(tmp_path):
    root = tmp_path / "corpus"
    root.mkdir()
    names = [f"mod{i}.py" for i in range(40)]
    names += [n for n in (f"val{i}.py" for i in range(400)) if split_of(n) == "validation"][:3]
    for n in names:
        (root / n).write_text("".join(f"def f{i}():\n    return {i}\n" for i in range(100)))
    out = tmp_path / "prompts.jsonl"
    main([str(out), "--root", str(root), "--every", "500", "--chars", "100"])
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    sources = {r["source"] for r in recs}
    held_out = {n for n in names if split_of(n) == "validation"}
    assert held_out and not sources & held_out and sources == set(names) - held_out
    assert all(r["text"].startswith("def ") or r["text"].startswith("    return") for r in recs)
    before = out.read_bytes()
    with pytest.raises(SystemExit, match="exists"):
        main([str(out), "--root", str(root)])
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
