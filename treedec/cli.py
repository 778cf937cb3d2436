"""What the entry points share: errors, renamed keys, output files, the model stack.

**Errors.** A wrong option, a missing file or a checkpoint that does not load is the user's to
fix, not a bug: it prints one line ``Error: <what is wrong and how to fix it>`` on stderr and exits with
status 1, instead of Hydra's traceback. ``HYDRA_FULL_ERROR=1`` shows the traceback again.
Hydra only passes ``SystemExit`` through (it turns other exceptions into tracebacks, and
exceptions in callbacks into warnings), hence :func:`fail`. What goes wrong before the task runs, while Hydra
composes the config (an unknown option or key, an override it cannot parse, a config file that is not valid
YAML), gets the same one line from :func:`launch`, which every ``python -m treedec.<entry>`` runs.

**Output files** are written atomically (:mod:`treedec.atomic`: a temp file, then a rename), so
a crash or a kill never leaves a half-written ``metrics.json`` for a sweep summary to trip over. A full
disk is a user error too: one line saying so and that what was written before is kept (:func:`disk_full`).
"""
from __future__ import annotations

import contextlib
import functools
import os
import runpy
import sys
from typing import Any, Callable, Iterator, NoReturn, TypeVar

import hydra._internal.hydra as hydra_app
import hydra._internal.utils as hydra_utils
from omegaconf.errors import MissingMandatoryValue

from treedec.atomic import DISK_FULL
from treedec.config import instantiate_checked
from treedec.config.checks import group_choices, required_error
from treedec.config.compose_errors import composition_message, yaml_message
from treedec.config.renamed import check_overrides
from treedec.errors import USER_ERRORS, ConfigError  # (ConfigError, CheckpointError, TreeError are ValueErrors)
from treedec.models.tokenizer import load_tokenizer

F = TypeVar("F", bound=Callable)


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (Hydra's and OmegaConf's messages span several)."""
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def fail(exc: BaseException | str) -> NoReturn:
    """Stop the program with ``Error: ...`` on stderr and exit status 1."""
    raise SystemExit(f"Error: {exc if isinstance(exc, str) else one_line(exc)}") from None


def disk_full(exc: OSError) -> str | None:
    """The one-line message for a write that found the disk (or the quota, or the file size limit) full; None
    for any other OSError."""
    if exc.errno not in DISK_FULL:
        return None
    where = f" writing {exc.filename}" if exc.filename else ""
    return (f"the disk is full{where} ({exc.strerror or os.strerror(exc.errno)}): every output is written to a "
            f"temp file and renamed, so no file was left half-written and the files already there (results, "
            f"checkpoints) are kept; free some space (or write elsewhere: hydra.run.dir=DIR) and run again (a "
            f"training job resumes from its newest checkpoint)")


def full_error() -> bool:
    """``HYDRA_FULL_ERROR=1``: every error keeps its traceback."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def user_message(exc: BaseException) -> str | None:
    """The one line a user's mistake prints (a user error, a required key left ``???``, a YAML file that does not
    parse, a full disk); None for a bug, which keeps its traceback."""
    if (msg := yaml_message(exc)) is not None:
        return msg
    if isinstance(exc, USER_ERRORS):
        return one_line(exc)
    if isinstance(exc, MissingMandatoryValue) and exc.full_key:  # a ??? key read before (or without) the schema check
        return one_line(required_error(str(exc.full_key), group_choices()))
    return disk_full(exc) if isinstance(exc, OSError) else None


def entry(fn: F) -> F:
    """Decorate a Hydra task function (under ``@hydra.main``): user errors become one ``Error:`` line."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            msg = user_message(exc)
            if msg is None or full_error():
                raise
            fail(msg)

    return wrapper  # type: ignore[return-value]


def launch(name: str, main: Callable[[], Any]) -> None:
    """Run entry point ``name``'s ``@hydra.main`` function ``main`` as ``python -m treedec.<name>`` does: renamed
    keys refused first (:func:`refuse_renamed`), then every error of Hydra's composition (an unknown group option
    or key, an override it cannot parse, a config file that is not valid YAML or does not fit the schema) as one
    ``Error:`` line (:func:`treedec.config.compose_errors.composition_message`)."""
    refuse_renamed(name)
    with composition_errors_as_one_line(name):
        main()


@contextlib.contextmanager
def composition_errors_as_one_line(name: str) -> Iterator[None]:
    """While Hydra runs entry point ``name``: the errors of its composition become one ``Error:`` line.

    Hydra composes inside its own ``run_and_report``, which prints such an error in several lines (or a stripped
    traceback) and exits before any code of ours runs; that one function is wrapped here, so every mode (run,
    multirun, ``--cfg``) is covered and anything else (a bug in a task) is still reported by Hydra itself."""
    report = hydra_utils.run_and_report

    def one_line(func: Callable[[], Any]) -> Any:
        try:
            return func()
        except Exception as exc:
            msg = None if full_error() else composition_message(exc, name)
            if msg is None:
                raise
            fail(msg)

    def run_and_report(func: Callable[[], Any]) -> Any:
        return report(lambda: one_line(func))

    modules = (hydra_utils, hydra_app)
    for module in modules:
        module.run_and_report = run_and_report  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for module in modules:
            module.run_and_report = report  # type: ignore[attr-defined]



def split_args(text: str) -> list[str]:
    """A command line given as one string (``make run ARGS="..."``) split as Hydra reads overrides: at spaces
    outside quotes, the quotes kept (``prompt='def f(x):'`` is one override with a quoted value); a word that is
    quoted whole is unquoted, as a shell would. An unclosed quote is an error."""
    words: list[str] = []
    word, quote, started = "", "", False
    for ch in text:
        if quote:
            word += ch
            quote = "" if ch == quote else quote
        elif ch.isspace():
            if started:
                words.append(word)
            word, started = "", False
        else:
            word, started = word + ch, True
            quote = ch if ch in "'\"" else ""
    if quote:
        fail(f"ARGS has an unclosed {quote} quote: {text.strip()!r}; close it (ARGS=\"prompt='def f(x):'\")")
    if started:
        words.append(word)
    return [w[1:-1] if w[0] in "'\"" and w.index(w[0], 1) == len(w) - 1 else w for w in words]


def run_module(module: str, args: str) -> None:
    """``python -m <module>`` with the overrides of one string (make's ARGS), split by :func:`split_args`: the
    shell's own quote removal would turn ``prompt='def f(x):'`` into an override Hydra cannot read."""
    sys.argv = [module, *split_args(args)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)

def refuse_renamed(name: str, argv: list[str] | None = None) -> None:
    """Before Hydra parses the command line: an override of a renamed key, or a run dir Hydra cannot make, of entry
    point ``name`` stops with one ``Error:`` line (:func:`treedec.config.renamed.check_overrides`)."""
    try:
        check_overrides(name, sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        fail(exc)


def load_stack(cfg: Any):
    """(target, tokenizer, draft head) from a config's ``model`` and ``draft`` groups, in eval mode.

    Each group names its loader with ``_target_`` (``treedec.models.load_model``,
    ``treedec.heads.load_head``), so a checkpoint format of your own is a config, not a code change.
    """
    target = instantiate_checked(cfg.model).eval()
    tok = load_tokenizer(cfg.model.path)
    dtype = cfg.draft.get("dtype") or target.dtype  # the draft group's dtype (auto: fp32 on a CPU), else the target's
    draft = instantiate_checked(cfg.draft, target=target, dtype=dtype, device=target.device).eval()
    return target, tok, draft

