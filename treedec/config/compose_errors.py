"""The one ``Error:`` line for a config that Hydra cannot compose, whichever entry point composes it.

Hydra composes an entry point's config before any task code runs and reports what goes wrong in several lines
of its own (or a YAML parser's traceback). :func:`composition_message` turns each of those errors into one line
that names the override, group, key or file (and its line), what is allowed there (the group's options, the
closest key) and the fix; :func:`treedec.cli.launch` applies it to every entry point. :func:`yaml_message` is
the line for a YAML file that does not parse, wherever it is read.
"""
from __future__ import annotations

import difflib
import re
import shlex
from pathlib import Path
from typing import Any

import yaml
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException, SearchPathException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ConfigTypeError, OmegaConfBaseException

from treedec.config.checks import unknown_key_hint
from treedec.models.paths import CONF


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "msg", None) or exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__


# ------------------------------------------------------------------------------------------ YAML files
_YAML_FIXES = (  # (a word of the parser's message, the fix)
    ("'\\t'", "indent with spaces: YAML does not allow a tab there"),
    ("flow sequence", "close the list with ] (or quote a value that starts with [)"),
    ("flow mapping", "close the mapping with } (or quote a value that starts with {)"),
    ("quoted scalar", "close the quote (or quote the whole value with the other kind of quote)"),
    ("mapping values", "quote a value that holds ': ', or put the key on its own line"),
    ("indentation", "indent the lines of one mapping or list alike, with spaces"),
)


def yaml_message(exc: BaseException) -> str | None:
    """``<file> line N: not valid YAML (...); <fix>`` for a YAML parser error with a position, else None."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return None
    mark = exc.context_mark or exc.problem_mark  # where the unclosed list, quote or block began, else the problem
    where = "the YAML text" if mark is None or str(mark.name).startswith("<") else str(mark.name)
    line = f" line {mark.line + 1}" if mark is not None else ""
    what = "; ".join(str(p) for p in (exc.context, exc.problem) if p)
    fix = next((f for word, f in _YAML_FIXES if word in what), "fix the YAML there")
    return f"{where}{line}: not valid YAML ({what}); {fix}"


# ------------------------------------------------------------------------------------------ config files
def config_file(name: str) -> str:
    """The file Hydra read config ``name`` (``local/default``) from, searched like Hydra searches (first hit)."""
    if GlobalHydra.instance().is_initialized():
        for source in GlobalHydra.instance().config_loader().get_sources():
            if source.is_config(name):
                root = source.full_path().removeprefix("file://")
                if source.full_path() == "pkg://treedec.conf":
                    root = str(CONF)
                return f"{root}/{name}.yaml"
    path = CONF / f"{name}.yaml"
    return str(path) if path.is_file() else f"{name}.yaml"


def key_line(path: str, key: str) -> int | None:
    """The line (1-based) of dotted ``key`` in the YAML mapping of ``path`` (None where it is not found)."""
    try:
        node = yaml.compose(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None
    line = None
    for part in key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        hit = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
        if hit is None:
            return None
        line, node = hit[0].start_mark.line + 1, hit[1]
    return line


def experiment_entries(name: str) -> dict[str, str]:
    """The entry points an experiment is made for, each with its command: the ``python -m treedec.<entry> ...
    experiment=<name>`` lines of the experiment's header comment (conf/experiment/<name>.yaml)."""
    path = CONF / "experiment" / f"{name}.yaml"
    text = path.read_text() if path.is_file() else ""
    found = re.findall(rf"(python -m treedec\.(\w+)\b[^\n]*?experiment={re.escape(name)})\b", text)
    return {entry: command for command, entry in reversed(found)}  # the first command of each entry


def _belongs_elsewhere(name: str, entry: str) -> str | None:
    """``experiment=<name> is an experiment of bench: ...`` where ``name`` is made for other entry points."""
    others = {e: c for e, c in experiment_entries(name).items() if e != entry}
    if not others:
        return None
    return (f"experiment={name} is an experiment of {' and '.join(others)}, not of {entry}: run "
            f"{' or '.join(others.values())}")


def _file_error(config: str, inner: BaseException | None, entry: str) -> str:
    """A config file (``local/default``, ``experiment/which_tree``) that composes into a wrong config."""
    group, _, option = config.rpartition("/")
    if group == "experiment" and isinstance(inner, ConfigKeyError) and (msg := _belongs_elsewhere(option, entry)):
        return msg
    path = config_file(config)
    key = str(getattr(inner, "full_key", "") or "")
    if group and key == group.replace("/", "."):  # its keys landed under the group's package: no header
        return (f"{path} is empty or lacks the first line `# @package _global_`, so its keys land under `{key}`, "
                f"which {entry} has no key for: make `# @package _global_` its first line and set keys below it "
                f"(as in {group}/default.yaml.example)" if group == "local" else
                f"{path} is empty or lacks the first line `# @package _global_`: add it, with keys below it")
    if isinstance(inner, ConfigTypeError) and "ListConfig" in str(inner):
        return (f"{path} holds a list, not a mapping of keys: write `key: value` lines below `# @package _global_` "
                f"(e.g. `model:` then `  device: cpu`)")
    line = key_line(path, key) if key else None
    at = f"{path}{f' line {line}' if line else ''}"
    if isinstance(inner, ConfigKeyError) and key:
        parent = key.rpartition(".")[0]
        return (f"{at}: {entry} has no key {key}. {_known_keys(inner, parent)}; fix or remove it "
                f"(a new key belongs in treedec/config/schema.py too)")
    if inner is not None and key:
        return f"{at}: {key}: {_first_line(inner)}; fix the value there"
    return f"{at}: {_first_line(inner) if inner is not None else 'it does not compose'}; fix it there"


def _known_keys(inner: OmegaConfBaseException, parent: str) -> str:
    """``Did you mean <closest>? Keys of <parent>: ...`` from the node (or schema) the unknown key was set on."""
    leaf = str(getattr(inner, "key", "") or str(inner.full_key).rpartition(".")[2])
    node = getattr(inner, "parent_node", None)
    schema = getattr(inner, "object_type", None)
    if node is not None and hasattr(node, "keys"):
        known = [str(k) for k in node.keys() if k != "_target_" and (parent or k != "hydra")]
    elif schema is not None and hasattr(schema, "__dataclass_fields__"):
        known = [k for k in schema.__dataclass_fields__ if k != "_target_"]
    else:
        return f"{parent or 'the config'} takes no key {leaf}"
    return unknown_key_hint(leaf, known, parent)


# ------------------------------------------------------------------------------------------ overrides
def _entry_groups(entry: str) -> list[str]:
    """The config groups in entry point ``entry``'s defaults list (conf/<entry>.yaml), ``hydra`` and ``schema``
    left out."""
    path = CONF / f"{entry}.yaml"
    groups = []
    for item in (OmegaConf.load(path).get("defaults") or []) if path.is_file() else []:
        if not hasattr(item, "keys"):  # _self_
            continue
        for key in item.keys():
            group = str(key).removeprefix("optional ").removeprefix("override ").split("@")[0].strip()
            if group not in ("hydra", "schema") and not group.startswith("hydra/"):
                groups.append(group)
    return groups


def quoted(override: str) -> str:
    """``key=value`` with its value quoted for Hydra, as a shell argument: ``'prompt="def f(x):"'``."""
    key, _, value = override.partition("=")
    value = value.strip().strip("'\"") if value.strip()[:1] in "'\"" else value
    q = "'" if '"' in value else '"'
    return shlex.quote(f"{key}={q}{value}{q}")


def _options(group: str, options: list[str]) -> str:
    if group != "experiment":
        return ", ".join(options)
    return ", ".join(f"{o} ({'/'.join(experiment_entries(o)) or 'any'})" for o in options)


def _missing_option(exc: Any, entry: str) -> str | None:
    missing = str(getattr(exc, "missing_cfg_file", "") or "")
    group, _, option = missing.rpartition("/")
    options = list(getattr(exc, "options", None) or [])
    if not group or not options:
        return None
    close = difflib.get_close_matches(option, options, n=1, cutoff=0.6)
    did = f"Did you mean {group}={close[0]}? " if close else ""
    return (f"{group}={option}: the config group {group} has no option {option!r}. {did}Pass {group}=<one of: "
            f"{_options(group, options)}> (the .yaml files of conf/{group}/, or of a --config-dir's {group}/)")


def _not_in_defaults(group: str, override: str, entry: str) -> str:
    if group == "experiment":
        value = override.partition("=")[2]
        elsewhere = _belongs_elsewhere(value, entry) if value else None
        users = [p.stem for p in sorted(CONF.glob("*.yaml")) if "experiment" in _entry_groups(p.stem)]
        return elsewhere or (f"{override}: {entry} has no experiment group (experiments are for "
                             f"{', '.join(users)}): drop it, or run one of those")
    groups = _entry_groups(entry)
    close = difflib.get_close_matches(group, groups, n=1, cutoff=0.6)
    did = f"Did you mean {close[0]}? " if close else ""
    return (f"{override}: {entry}'s config has no group {group} in its defaults. {did}Groups of {entry}: "
            f"{', '.join(groups)} (a group that only another option brings in is added with +{override})")


def composition_message(exc: BaseException, entry: str) -> str | None:
    """The one line for an error Hydra raised while composing ``entry``'s config; None for anything else."""
    if (msg := yaml_message(exc)) is not None:
        return msg
    if isinstance(exc, OverrideParseException):
        override = str(exc.override)
        why = str(exc.message).strip().splitlines()[0]
        if "=" not in override:
            return f"cannot read the override {override!r} ({why}): pass key=value"
        key = override.partition("=")[0]
        make = f" (with make: make run ARGS=\"{key}='...'\")" if entry == "generate" else ""
        return (f"cannot read the override {override!r} ({why}): Hydra reads ()[]{{}}:,= and quotes in a value "
                f"as syntax, so quote the value for Hydra: {quoted(override)}{make}")
    if isinstance(exc, SearchPathException):
        return f"{_first_line(exc)}: pass an existing directory to --config-dir"
    if not isinstance(exc, ConfigCompositionException):
        return None
    if isinstance(exc, MissingConfigException) and (msg := _missing_option(exc, entry)):
        return msg
    text, inner = str(exc), exc.__cause__ or exc.__context__
    inner = inner if isinstance(inner, OmegaConfBaseException) else None
    where = ""
    if m := re.match(r"In '([^']+)': ", text):  # an error in a config file (local/default, an experiment)
        config = m.group(1)
        group, _, option = config.rpartition("/")
        if group == "experiment" and (msg := _belongs_elsewhere(option, entry)):
            return msg
        if re.match(r"\w+ raised while composing config", text[m.end():]):
            return _file_error(config, inner, entry)
        text, where = text[m.end():], f"{config_file(config)}: "
    if m := re.match(r"Could not override '([^']+)'\.", text):
        key = m.group(1)
        override = (re.search(r"use \+(\S+)", text) or m).group(1)
        if "No match in the defaults list" in text:
            return where + _not_in_defaults(key, override, entry)
        if inner is not None and isinstance(inner, (ConfigKeyError, AttributeError)):
            parent = key.rpartition(".")[0]
            return f"{where}{override}: {entry} has no key {key}. {_known_keys(inner, parent)}"
    if m := re.match(r"Error merging override (\S+)", text):
        return f"{where}{m.group(1)}: {_first_line(inner) if inner else text}; pass a value of that key's type"
    if m := re.match(r"Multiple values for (\S+?)\.", text):
        group = m.group(1)
        return (f"{where}+{group}=...: {group} is already in {entry}'s defaults list: pass {group}=NAME (without +) "
                f"to choose its option")
    detail = f" ({_first_line(inner)})" if inner is not None else ""
    return f"{where}{text.strip().splitlines()[0]}{detail}"
