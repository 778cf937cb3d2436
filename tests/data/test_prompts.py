"""Prompt sets (treedec/data/prompts.py): third-party code outside the training corpus, prompt files."""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

import treedec
from treedec.config import ConfigError
from treedec.data import prompts as P

STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
TREEDEC = Path(treedec.__file__).resolve().parent


def _outside_training_corpus(path: str) -> bool:
    """In a site-packages folder, not treedec, and not a file the stdlib corpus lists (it skips site-packages)."""
    p = Path(path).resolve()
    in_site = any(d in p.parents for d in P.site_dirs())
    stdlib_corpus = STDLIB in p.parents and not {"site-packages", "dist-packages"} & set(p.relative_to(STDLIB).parts)
    return in_site and not stdlib_corpus and TREEDEC not in p.parents


def test_third_party_prompts_are_deterministic_non_empty_and_outside_the_stdlib():
    a = P.third_party_prompts(6, 64, seed=0)
    b = P.third_party_prompts(6, 64, seed=0)
    assert len(a) == 6 and [(p.id, p.text, p.source) for p in a] == [(p.id, p.text, p.source) for p in b]
    assert len({p.id for p in a}) == 6
    assert len({p.source["file"] for p in a}) == 6  # one package per prompt in the first round
    for p in a:
        assert _outside_training_corpus(p.source["file"]), p.source
        assert p.text.strip() and P._DEF.match(p.text.splitlines()[-1]), p.text[-200:]
        header = Path(p.source["file"]).read_text(errors="replace").splitlines()[p.source["line"] - 1]
        assert p.text.splitlines()[-1] == header  # the recorded line is the prompt's last (def) line
        assert P.token_counter(None)(p.text) <= 64 or len(p.text.splitlines()) == 1
    c = P.third_party_prompts(6, 64, seed=1)
    assert [p.source for p in c] != [p.source for p in a]  # the seed picks another set


def test_third_party_selection_skips_stdlib_treedec_and_metadata(tmp_path):
    site = tmp_path / "site-packages"
    body = "import os\n\n\nclass A:\n    x = 1\n\n    def method(self, y):\n        return y\n"
    for rel in ("pkg_a/__init__.py", "pkg_a/sub/mod.py", "pkg_b.py", "treedec/core.py", "__editable___x_finder.py",
                "pkg_a-1.0.dist-info/x.py", "pkg_a/__pycache__/mod.py"):
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(body)
    (site / "json_link").symlink_to(STDLIB / "json")  # a link into the stdlib is not third party
    found = P.third_party_packages([site])
    assert sorted(found) == ["pkg_a", "pkg_b"]
    assert [f.relative_to(site).as_posix() for f in found["pkg_a"]] == ["pkg_a/__init__.py", "pkg_a/sub/mod.py"]
    got = P.third_party_prompts(3, 1000, seed=0, dirs=[site])
    assert [p.id for p in got][:2] in (["pkg_a0", "pkg_b0"], ["pkg_b0", "pkg_a0"]) and len(got) == 3
    head = "".join(body.splitlines(keepends=True)[:7])  # up to the def header; all of it fits in 1000 tokens
    assert all(p.text == head for p in got)
    one = P.third_party_prompts(1, 3, seed=0, dirs=[site])[0]
    assert one.text == "    def method(self, y):\n"  # only the header fits in 3 tokens
    assert [p.id for p in P.third_party_prompts(2, 64, packages=["pkg_b"], dirs=[site])] == ["pkg_b0"]
    with pytest.raises(ConfigError, match="third-party package.*nope.*not installed.*installed: pkg_a, pkg_b"):
        P.third_party_prompts(2, 64, packages=["nope"], dirs=[site])


def test_load_prompt_set_sources():
    assert P.load_prompt_set("third_party", 2, 32, seed=3)[0].source["package"]
    with pytest.raises(ConfigError, match="unknown prompt source 'pypi'; choose one of stdlib, third_party"):
        P.load_prompt_set("pypi", 2, 32)


def test_prompt_file_errors_name_path_and_line(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" + json.dumps("plain string") + "\n\n"
                 + json.dumps({"text": "y", "id": 7}) + "\n")
    got = P.read_prompt_file(f)
    assert [(p.id, p.text, p.source["line"]) for p in got] == [("a", "x", 1), ("p1", "plain string", 2), ("7", "y", 4)]
    cases = {
        '{"prompt": "a"}\n{"prompt": "b"\n': r"p.jsonl:2: not valid JSON",
        '{"id": "a", "prompt": "x"}\n\n{"id": "a", "prompt": "y"}\n': r"p.jsonl:3: prompt id 'a' is already used on line 1",
        '{"idx": 1}\n': r"p.jsonl:1: a prompt object needs a string field prompt / text / content / input",
        '[1, 2]\n': r"p.jsonl:1: expected a JSON string or an object with a prompt, got list",
        '\n\n': r"p.jsonl holds no prompts",
        '{"prompt": "a\\ud800b"}\n': r"p.jsonl:1: holds a lone UTF-16 surrogate",  # (issue 39.15: calibrate's prompts)
        "[" * 100000 + "\n": r"p.jsonl:1: nested too deeply to read",
    }
    for text, needle in cases.items():
        f.write_text(text)
        with pytest.raises(ConfigError, match=needle):
            P.read_prompt_file(f)
    with pytest.raises(FileNotFoundError, match="bench.prompts='.*none.jsonl': no such file"):
        P.read_prompt_file(tmp_path / "none.jsonl", "bench.prompts")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        P.read_text(tmp_path, "prompt_file")
    (tmp_path / "blob.py").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ConfigError, match="prompt_file='.*blob.py' is not UTF-8 text"):
        P.read_text(tmp_path / "blob.py", "prompt_file")
    (tmp_path / "task.py").write_text("def f(x):\n")
    assert P.read_prompt_file(tmp_path / "task.py")[0].text == "def f(x):\n"
