"""The benchmark's config check: the schema's (:func:`treedec.config_checks.validate`), then bench's own options."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from treedec.bench import PEERS, bundled
from treedec.config_checks import ConfigError, unknown_key_hint, validate, validate_tree, value_at
from treedec.data.prompts import SOURCES, read_prompt_file


def validate_bench(cfg: DictConfig) -> None:
    """Raise :class:`ConfigError` for anything wrong in a composed ``bench`` config, before any model loads."""
    validate(cfg, "bench")
    check_bench(cfg)


def check_bench(cfg) -> None:
    """bench.* beyond the schema: prompt source and file, learned tree and assistant paths, trees, methods,
    temperatures and peers (before any model loads)."""
    b = "bench."
    source = value_at(cfg, b + "prompt_source")
    if source not in SOURCES:
        raise ConfigError(f"bench.prompt_source={source!r}; choose one of {', '.join(SOURCES)} "
                          f"(or bench.prompts=<file.jsonl>)")
    if value_at(cfg, b + "prompts"):
        read_prompt_file(value_at(cfg, b + "prompts"), "bench.prompts")

    learned = value_at(cfg, b + "learned_path")
    if learned not in (None, bundled.AUTO) and not Path(learned).expanduser().is_file():
        raise ConfigError(f"bench.learned_path={learned!r}: no such file; pass the learned_tree.yaml that "
                          f"`python -m treedec.calibrate` wrote (auto: the tree shipped for the bundled head; "
                          f"null: skip the `learned` method)")
    assistant = value_at(cfg, b + "assistant_path")
    if assistant not in (None, bundled.AUTO, bundled.ASSISTANT) and not Path(assistant).expanduser().is_dir():
        raise ConfigError(f"bench.assistant_path={assistant!r} is not a model directory (auto: {bundled.ASSISTANT} "
                          f"for the bundled target; null: skip hf_assisted)")
    trees = value_at(cfg, b + "trees") or {}
    for name in trees:
        validate_tree(trees[name], f"bench.trees.{name}")
    for name in value_at(cfg, b + "methods") or []:
        if name != "vanilla" and name not in trees:
            raise ConfigError(f"bench.methods names {name!r}, which has no tree config under bench.trees (add "
                              f"bench.trees.{name} with a _target_). "
                              f"{unknown_key_hint(name, ['vanilla', *trees], label='Methods')}")
    temps = value_at(cfg, b + "sample_temperatures")
    if temps is not None:
        if not temps:
            raise ConfigError("bench.sample_temperatures=[]: list at least one temperature (or null: the sampling "
                              "group's own)")
        bad = [t for t in temps if not 0 < t < float("inf")]
        if bad:
            raise ConfigError(f"bench.sample_temperatures has {bad[0]}: every temperature must be > 0 "
                              f"(0 is greedy decoding, which the greedy rows already cover)")
        if len({f"{t:g}" for t in temps}) != len(temps):  # as metrics.json names the groups
            raise ConfigError(f"bench.sample_temperatures={list(temps)} repeats a temperature")

    for name in value_at(cfg, b + "peers") or []:
        if name not in PEERS:
            raise ConfigError(f"bench.peers names {name!r}. {unknown_key_hint(name, PEERS, label='Peers')}")


__all__ = ["check_bench", "validate_bench"]
