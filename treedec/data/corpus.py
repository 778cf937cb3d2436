"""The corpora and their train/validation split, both decided by a hash so no machine or file order matters.

* The stdlib corpus: :func:`corpus_files` lists the ``*.py`` files under a root (default: ``sysconfig``'s
  ``stdlib``), skipping ``site-packages``, ``test``/``tests``/``idle_test`` dirs and caches;
  :func:`split_of` assigns a file to ``train`` or ``validation`` by a SHA-1 of its relative path.
* The user's corpus, one JSON object per line (``{"text": ...}`` or ShareGPT-style
  ``{"conversations": [{"from": "human", "value": ...}, ...]}``): :func:`read_jsonl` parses it with errors
  naming the line; :func:`line_split` assigns a line by a SHA-1 of its bytes.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # an escaped UTF-16 surrogate, paired or not
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def _hash_fraction(data: bytes) -> float:
    """A number in [0, 1) from the SHA-1 of ``data``: the split's coin."""
    return int.from_bytes(hashlib.sha1(data).digest()[:8], "big") / 2**64


# --------------------------------------------------------------------------- stdlib corpus
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: str | os.PathLike | None = None) -> list[str]:
    """Sorted POSIX paths (relative to ``root``) of the corpus's ``*.py`` files."""
    root = Path(root) if root else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory")
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS and not x.startswith("."))
        rel = Path(d).relative_to(root)
        out += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(out)


def split_of(relpath: str, val_fraction: float = 0.03) -> str:
    """'validation' for about ``val_fraction`` of the files, by a hash of the path; else 'train'."""
    return "validation" if _hash_fraction(relpath.encode()) < val_fraction else "train"


def split_files(root: str | os.PathLike | None = None, split: str = "train", val_fraction: float = 0.03) -> list[str]:
    return [f for f in corpus_files(root) if split_of(f, val_fraction) == split]


def read_source(root: str | os.PathLike, relpath: str) -> str:
    return (Path(root) / relpath).read_bytes().decode("utf-8", errors="replace")


def corpus_fingerprint(root: str | os.PathLike | None = None, val_fraction: float = 0.03) -> str:
    """SHA-1 over every file's path, split and content: changes whenever the corpus does."""
    root = Path(root) if root else stdlib_root()
    h = hashlib.sha1(f"v1 {val_fraction}".encode())
    for f in corpus_files(root):
        h.update(f.encode() + b"\0" + (root / f).read_bytes() + b"\0")
    return h.hexdigest()


# --------------------------------------------------------------------------- JSON-lines corpus
def parse_record(obj, where: str) -> tuple[str, str | list[dict]]:
    """One parsed JSONL line as ``("text", str)`` or ``("chat", [{"role", "content"}, ...])``.

    Chat lines are ShareGPT-style ``{"conversations": [{"from": "human", "value": ...}, ...]}``
    (``"role"``/``"content"`` and a ``"messages"`` list are accepted too); roles ``human``/``user``,
    ``gpt``/``assistant`` and ``system`` map to user, assistant and system. ``where`` names the
    line in error messages.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    conv = obj.get("conversations", obj.get("messages"))
    if conv is not None:
        if not isinstance(conv, list) or not conv:
            raise ValueError(f"{where}: 'conversations' must be a non-empty list of turns")
        msgs = []
        for k, turn in enumerate(conv):
            if not isinstance(turn, dict):
                raise ValueError(f"{where}: turn {k} is a {type(turn).__name__}, not an object")
            role = turn.get("from", turn.get("role"))
            content = turn.get("value", turn.get("content"))
            if role is None or content is None:
                raise ValueError(f"{where}: turn {k} needs 'from' (or 'role') and 'value' (or 'content'); "
                                 f"it has {sorted(turn)}")
            if not isinstance(content, str):
                raise ValueError(f"{where}: turn {k}: the content must be a string, not {type(content).__name__}")
            r = ROLES.get(str(role).strip().lower())
            if r is None:
                raise ValueError(f"{where}: turn {k} has unknown role {role!r}; known roles: human/user, "
                                 f"gpt/assistant, system")
            msgs.append({"role": r, "content": content})
        return "chat", msgs
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise ValueError(f"{where}: 'text' must be a string, not {type(obj['text']).__name__}")
        return "text", obj["text"]
    raise ValueError(f"{where}: a line needs a 'text' string or a 'conversations' list; it has keys {sorted(obj)}")


def jsonl_files(path: str | os.PathLike) -> list[Path]:
    """The files a ``data.path`` names: a file, a directory (its ``*.jsonl``, sorted) or a glob (sorted),
    e.g. the shards ``python -m treedec.regenerate`` writes."""
    path = Path(path)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(path.glob("*.jsonl"))
    else:
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file()) if glob.has_magic(str(path)) else []
    if not files:
        raise FileNotFoundError(f"jsonl corpus {path} does not exist or holds no *.jsonl file "
                                f"(data.path / data.val_path: a file, a directory of shards or a glob)")
    return files


def parse_json_line(raw: bytes | str, where: str):
    """One JSON line's value. Invalid JSON, nesting deeper than Python's recursion limit and a lone UTF-16
    surrogate (``"\\ud800"``, which no UTF-8 text holds: the tokenizer and the output writer would fail on it
    long after the model loaded) are each a ValueError naming ``where`` (``file:line``)."""
    try:
        obj = json.loads(raw)
        if _SURROGATE.search(raw if isinstance(raw, bytes) else raw.encode()):  # (a cheap look first)
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    except UnicodeEncodeError:
        raise ValueError(f"{where}: holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is no "
                         f"text; fix the escape or drop the line") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply to read (over about {sys.getrecursionlimit()} levels of "
                         f"[ or {{); flatten the record or drop the line") from None
    return obj


def read_jsonl(path: str | os.PathLike, errors: list | None = None
               ) -> Iterator[tuple[int, bytes, str, str | list[dict]]]:
    """``(line number, raw line, kind, payload)`` for every non-blank line; clear errors name the line.

    ``errors``: a list to append ``(line number, message)`` of each malformed line to, skipping it,
    instead of raising at the first one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"jsonl corpus {path} does not exist (data.path / data.val_path)")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            raw = raw.strip()
            if not raw:
                continue
            where = f"{path}:{lineno}"
            try:
                kind, payload = parse_record(parse_json_line(raw, where), where)
            except ValueError as exc:
                if errors is None:
                    raise
                errors.append((lineno, str(exc)))
                continue
            yield lineno, raw, kind, payload


def line_split(raw: bytes, val_fraction: float) -> str:
    """'validation' for about ``val_fraction`` of the lines, by a SHA-1 of the line's bytes; else 'train'."""
    return "validation" if _hash_fraction(raw) < val_fraction else "train"


__all__ = ["ROLES", "SKIP_DIRS", "corpus_files", "corpus_fingerprint", "jsonl_files", "line_split", "parse_json_line",
           "parse_record", "read_jsonl", "read_source", "split_files", "split_of", "stdlib_root"]
