"""Prompt sets: held-out prompts and prompt files, for bench, calibrate, generate and train.

* ``stdlib``: code from the validation files of the stdlib corpus the bundled model trained on
  (:func:`heldout_prompts`; training's τ callback uses them too): held out, but the same kind of code.
* ``third_party``: code of installed third-party packages (site-packages: numpy, torch,
  transformers, hydra, ...; never the stdlib, never treedec), which the bundled model never
  saw. The selection is deterministic for a given set of installed packages: packages in
  sorted order, shuffled by ``seed``, one prompt per package per round, the file and the
  ``def`` line drawn with the same seeded generator from sorted lists.
* a file: ``.jsonl`` (one string, or one object with ``prompt`` (or ``text``, ``content``,
  ``input``) and an optional ``id``, per line) or any text file (one prompt).

Like the stdlib prompts, a generated prompt is the code before a one-line ``def`` header,
header included, cut to at most ``prompt_tokens`` tokens on a line boundary.
"""
from __future__ import annotations

import os
import random
import re
import site
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable, Sequence

from treedec.data.corpus import parse_json_line, read_source, split_files, stdlib_root
from treedec.errors import ConfigError

SOURCES = ("stdlib", "third_party")
PROMPT_KEYS = ("prompt", "text", "content", "input")
_DEF = re.compile(r"^\s*(async\s+)?def\s+\w+\s*\(.*\)\s*(->\s*[^:]+)?:\s*$")
_SKIP_TOP = re.compile(r"^(__pycache__|__editable__.*|_virtualenv.*|.*\.(dist|egg)-info|.*\.data)$")
_SKIP_DIRS = frozenset({"__pycache__", ".git"})
MAX_FILE_BYTES = 1 << 20  # larger files are generated code (protobuf, tables), not prompts
MIN_CONTEXT_LINES = 3


@dataclass
class PromptText:
    id: str
    text: str
    source: dict | None = None  # where it came from: {"file", "line", "package"} (third_party) or {"file", "line"}


PROMPT_CAP_ENV = "TREEDEC_PROMPT_MAX_BYTES"
DEFAULT_PROMPT_CAP = 16 << 20  # 16 MiB: far more text than any model's context, far less than a runaway read


def prompt_cap() -> int:
    """The most bytes a prompt file (or stdin) may hold: ``$TREEDEC_PROMPT_MAX_BYTES``, else 16 MiB. A cap, so
    that ``prompt_file=/dev/zero`` or an endless pipe is an error, not a read that fills the memory."""
    raw = os.environ.get(PROMPT_CAP_ENV)
    if raw is None:
        return DEFAULT_PROMPT_CAP
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ConfigError(f"{PROMPT_CAP_ENV}={raw!r} must be a whole number of bytes >= 1 (unset: "
                          f"{DEFAULT_PROMPT_CAP} bytes)")
    return int(raw)


def _over_cap(where: str, size: str, cap: int) -> ConfigError:
    return ConfigError(f"{where} holds {size} bytes, over the {cap}-byte cap on prompt text; pass a smaller "
                       f"file, or raise the cap: {PROMPT_CAP_ENV}=<bytes>")


def _decode(data: bytes, where: str, fix: str) -> str:
    """``data`` as UTF-8 text; binary data (NUL bytes, invalid UTF-8) is a ConfigError naming ``where``."""
    bad = data.find(b"\0")  # valid UTF-8, but no text file holds NUL bytes
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = exc.start if bad < 0 else min(bad, exc.start)
    if bad >= 0:
        raise ConfigError(f"{where} is not UTF-8 text (binary data at byte {bad}); {fix}")
    return text


def read_text(path: str | os.PathLike, key: str) -> str:
    """The text of a prompt file; missing, a directory, not a regular file (``/dev/zero``, a pipe), over
    :func:`prompt_cap` or binary is a clear error naming ``key``."""
    p = Path(path).expanduser()
    where = f"{key}={str(path)!r}"
    if not p.exists():
        raise FileNotFoundError(f"{where}: no such file; pass the path of a text file")
    if p.is_dir():
        raise IsADirectoryError(f"{where} is a directory; pass the path of a text file")
    if not p.is_file():  # read twice (checked, then used): a device or a pipe would never end, or be empty
        raise ConfigError(f"{where} is not a regular file (a device or a pipe); pass the path of a text file"
                          + (" (prompt_file=- reads stdin)" if key == "prompt_file" else ""))
    cap = prompt_cap()
    with p.open("rb") as f:
        data = f.read(cap + 1)  # the size from stat can change under us: the read itself stops at the cap
    if len(data) > cap:
        raise _over_cap(where, f"{p.stat().st_size}", cap)
    return _decode(data, where, "pass a text file")


def read_stdin(key: str = "prompt_file") -> str:
    """The prompt piped to stdin (``prompt_file=-``), read up to :func:`prompt_cap` bytes: an endless pipe or
    binary (not UTF-8) input is a one-line error naming ``key``."""
    where, cap = f"{key}=- (stdin)", prompt_cap()
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        raise ConfigError(f"{where}: there is no stdin to read; pipe the prompt in, or pass {key}=<file>")
    data = stream.read(cap + 1)
    if len(data) > cap:
        raise _over_cap(where, f"more than {cap}", cap)
    return _decode(data, where, "pipe UTF-8 text in")


def read_prompt_file(path: str | os.PathLike, key: str = "prompts") -> list[PromptText]:
    """Prompts of a ``.jsonl`` file (one per line) or a text file (one prompt); errors say ``path:line``."""
    text = read_text(path, key)
    p = Path(path).expanduser()
    if p.suffix != ".jsonl":
        if not text.strip():
            raise ConfigError(f"{key}={str(path)!r} is empty; write the prompt into it")
        return [PromptText(p.stem, text, {"file": str(p), "line": 1})]
    out: list[PromptText] = []
    seen: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:  # (invalid JSON, nesting too deep and lone surrogates are each one line naming p:n)
            obj = parse_json_line(line, f"{p}:{n}")
        except ValueError as exc:
            raise ConfigError(f"{exc}; write one prompt per line: a JSON string, or an object like "
                              '''{"id": "a", "prompt": "def f(x):"}''') from None
        pid = None
        if isinstance(obj, dict):
            key_ = next((k for k in PROMPT_KEYS if isinstance(obj.get(k), str)), None)
            if key_ is None:
                raise ConfigError(f"{p}:{n}: a prompt object needs a string field {' / '.join(PROMPT_KEYS)}, "
                                  f"got the keys {', '.join(map(str, obj)) or 'none'}")
            pid = obj.get("id")
            obj = obj[key_]
        if not isinstance(obj, str):
            raise ConfigError(f"{p}:{n}: expected a JSON string or an object with a prompt, got {type(obj).__name__}")
        pid = str(pid) if pid is not None else f"p{len(out)}"
        if pid in seen:
            raise ConfigError(f"{p}:{n}: prompt id {pid!r} is already used on line {seen[pid]}; give every "
                              f"prompt its own id")
        seen[pid] = n
        out.append(PromptText(pid, obj, {"file": str(p), "line": n}))
    if not out:
        raise ConfigError(f"{p} holds no prompts; write one JSON string or object per line")
    return out


def token_counter(tokenizer) -> Callable[[str], int]:
    """Tokens in a text (a treedec or ``tokenizers`` tokenizer; None: about 4 characters per token)."""
    if tokenizer is None:
        return lambda text: (len(text) + 3) // 4
    if not hasattr(tokenizer, "whole_chars"):  # a bare tokenizers.Tokenizer, not treedec's
        return lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)
    return lambda text: len(tokenizer.encode(text, add_bos=False))


def cut_before(lines: Sequence[str], i: int, prompt_tokens: int, count: Callable[[str], int]) -> str:
    """Lines ``[start, i]`` with the earliest ``start`` whose text still fits in ``prompt_tokens`` tokens."""
    start = i
    while start > 0 and count("".join(lines[start - 1:i + 1])) <= prompt_tokens:
        start -= 1
    text = "".join(lines[start:i + 1])
    return text if text.endswith("\n") else text + "\n"


def heldout_prompts(n: int = 16, prompt_tokens: int = 128, root=None, val_fraction: float = 0.03,
                    tokenizer=None, min_context_lines: int = MIN_CONTEXT_LINES) -> list[str]:
    """``n`` prompts from the corpus's validation files: the code before a one-line ``def`` header, header included.

    Each prompt ends right after a function signature (``...:\\n``), so the model continues
    with its docstring/body; its leading context is cut on a line boundary to at most
    ``prompt_tokens`` tokens (:func:`token_counter`). Deterministic: the candidates are spaced
    evenly over all validation functions in path order.
    """
    root = Path(root) if root else stdlib_root()
    cands: list[tuple[str, int]] = []
    sources = {}
    for f in split_files(root, "validation", val_fraction):
        lines = read_source(root, f).splitlines(keepends=True)
        sources[f] = lines
        cands += [(f, i) for i, ln in enumerate(lines) if i >= min_context_lines and _DEF.match(ln)]
    if not cands:
        return []
    k = min(n, len(cands))
    count = token_counter(tokenizer)
    return [cut_before(sources[f], i, prompt_tokens, count) for f, i in (cands[int(j * len(cands) / k)] for j in range(k))]


def stdlib_prompts(n: int, prompt_tokens: int, tokenizer=None, root=None,
                   val_fraction: float = 0.03) -> list[PromptText]:
    """``n`` held-out prompts from the stdlib corpus's validation files (what the bundled model never trained on)."""
    texts = heldout_prompts(n, prompt_tokens, root=root, val_fraction=val_fraction, tokenizer=tokenizer)
    return [PromptText(f"heldout{i}", t) for i, t in enumerate(texts)]


# ------------------------------------------------------------------------------------ third party
def site_dirs() -> list[Path]:
    """This interpreter's site-packages folders (sorted, existing, no duplicates)."""
    cands = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")] + list(site.getsitepackages())
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    return sorted({Path(d).resolve() for d in [*cands, *([user] if user else [])] if Path(d).is_dir()})


def _excluded_roots() -> tuple[Path, Path]:
    """Code that is not third party: the stdlib (outside site-packages), and treedec itself."""
    return (Path(sysconfig.get_paths()["stdlib"]).resolve(), Path(__file__).resolve().parents[1])


def _inside(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def third_party_packages(dirs: Sequence[Path] | None = None) -> dict[str, list[Path]]:
    """Top-level package (or module) name -> its sorted ``.py`` files, over ``dirs`` (default :func:`site_dirs`)."""
    dirs = [Path(d).resolve() for d in (site_dirs() if dirs is None else dirs)]
    stdlib, own = _excluded_roots()
    out: dict[str, list[Path]] = {}
    for d in dirs:
        for entry in sorted(d.iterdir()):
            name = entry.name.removesuffix(".py")
            if _SKIP_TOP.match(entry.name) or entry.name.startswith(".") or name == "treedec" or name in out:
                continue
            real = entry.resolve()
            if _inside(real, own) or (_inside(real, stdlib) and not any(_inside(real, s) for s in dirs)):
                continue
            if entry.is_file() and entry.suffix == ".py":
                files = [entry]
            elif entry.is_dir():
                files = []
                for root, sub, names in os.walk(entry):
                    sub[:] = sorted(s for s in sub if s not in _SKIP_DIRS and not s.startswith("."))
                    files += [Path(root) / f for f in sorted(names) if f.endswith(".py")]
            else:
                continue
            if files:
                out[name] = files
    return out


def _package_versions() -> dict[str, str]:
    try:
        dists = metadata.packages_distributions()
    except Exception:  # versions are a courtesy in the record: none rather than a failed run
        return {}
    out = {}
    for top, names in dists.items():
        try:
            out[top] = f"{names[0]} {metadata.version(names[0])}"
        except Exception:  # a distribution without readable metadata: left out
            continue
    return out


def third_party_prompts(n: int, prompt_tokens: int, tokenizer=None, seed: int = 0,
                        packages: Sequence[str] | None = None, dirs: Sequence[Path] | None = None,
                        max_tries: int = 8) -> list[PromptText]:
    """``n`` prompts from installed third-party packages (or only ``packages``), one per package per round."""
    found = third_party_packages(dirs)
    if packages is not None:
        missing = [p for p in packages if p not in found]
        if missing:
            raise ConfigError(f"third-party package(s) {', '.join(missing)} not installed here (or not Python "
                              f"source); installed: {', '.join(sorted(found, key=str.lower))}")
        found = {p: found[p] for p in packages}
    names = sorted(found)
    rng = random.Random(seed)
    rng.shuffle(names)
    count = token_counter(tokenizer)
    versions = _package_versions()
    out: list[PromptText] = []
    per_package: Counter = Counter()
    used: set[tuple[Path, int]] = set()
    while len(out) < n and names:
        exhausted = []
        for name in names:
            if len(out) >= n:
                break
            files = found[name]
            for _ in range(max_tries):
                f = files[rng.randrange(len(files))]
                try:
                    if f.stat().st_size > MAX_FILE_BYTES:
                        continue
                    lines = f.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True)
                except OSError:
                    continue
                defs = [i for i, ln in enumerate(lines) if i >= MIN_CONTEXT_LINES and _DEF.match(ln)
                        and (f, i) not in used]
                if defs:
                    i = defs[rng.randrange(len(defs))]
                    used.add((f, i))
                    src = {"file": str(f), "line": i + 1, "package": versions.get(name, name)}
                    out.append(PromptText(f"{name}{per_package[name]}", cut_before(lines, i, prompt_tokens, count),
                                          src))
                    per_package[name] += 1
                    break
            else:
                exhausted.append(name)
        names = [x for x in names if x not in exhausted]
    return out


def load_prompt_set(source: str, n: int, prompt_tokens: int, tokenizer=None, seed: int = 0, root=None,
                    val_fraction: float = 0.03, packages: Sequence[str] | None = None,
                    hint: str = "pass a prompt file instead") -> list[PromptText]:
    """``n`` prompts of a generated ``source`` (stdlib | third_party); an empty set is a clear error."""
    if source == "stdlib":
        out = stdlib_prompts(n, prompt_tokens, tokenizer, root=root, val_fraction=val_fraction)
        where = f"the validation files of {root or 'the stdlib'} (val_fraction {val_fraction})"
    elif source == "third_party":
        out = third_party_prompts(n, prompt_tokens, tokenizer, seed, packages)
        where = f"the third-party packages in {', '.join(map(str, site_dirs())) or 'no site-packages folder'}"
    else:
        raise ConfigError(f"unknown prompt source {source!r}; choose one of {', '.join(SOURCES)}")
    if not out:
        raise ConfigError(f"no prompt found in {where}: no file there has a one-line `def` header after "
                          f"{MIN_CONTEXT_LINES} lines; {hint}")
    return out


__all__ = ["PROMPT_KEYS", "SOURCES", "PromptText", "cut_before", "heldout_prompts", "load_prompt_set", "prompt_cap",
           "read_prompt_file", "read_stdin", "read_text", "site_dirs", "stdlib_prompts", "third_party_packages",
           "third_party_prompts", "token_counter"]
