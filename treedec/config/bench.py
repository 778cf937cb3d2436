"""The benchmark's combination checks (``bench.*`` beyond the schema), run by :func:`treedec.config.validate`
after the schema merge: the benchmark sits above the config layer, so the names it checks against (its peers,
the bundled companions) live here and in :mod:`treedec.config.bundled`."""
from __future__ import annotations

from pathlib import Path

from treedec.config.bundled import ASSISTANT, AUTO
from treedec.config.checks import at_least, check_rules, unknown_key_hint, validate_tree, value_at
from treedec.data.prompts import SOURCES, read_prompt_file
from treedec.errors import ConfigError
from treedec.models.paths import ASSETS, CONF

PEERS = ("hf_greedy", "hf_prompt_lookup", "hf_assisted", "hf_sample",  # the peers a bench can run (bench/peers.py,
         "vllm", "vllm_eagle", "vllm_eagle3", "vllm_peagle")              # bench/vllm_peers.py)

_RULES = [
    ("bench.n_prompts", at_least(1), ">= 1"), ("bench.prompt_tokens", at_least(1), ">= 1"),
    ("bench.max_new_tokens", at_least(1), ">= 1"),
    ("bench.repeats", at_least(1), ">= 1 (timed passes; the median is reported)"),
    ("bench.warmup", at_least(0), ">= 0"), ("bench.num_threads", at_least(1), ">= 1 (or null: torch's current count)"),
    ("bench.tie_ulps", at_least(0), ">= 0"), ("bench.prompt_lookup_num_tokens", at_least(1), ">= 1"),
    ("bench.batch_mode", lambda v: v in ("continuous", "static"),
     "continuous (a queue of prompts through b slots) or static (full batches of b)"),
]


def check_bench(cfg) -> None:
    """bench.* beyond the schema: counts, prompt source and file, learned tree and assistant paths, trees, methods,
    temperatures, heads and peers (before any model loads)."""
    check_rules(cfg, _RULES)
    b = "bench."
    source = value_at(cfg, b + "prompt_source")
    if source not in SOURCES:
        raise ConfigError(f"bench.prompt_source={source!r}; choose one of {', '.join(SOURCES)} "
                          f"(or bench.prompts=<file.jsonl>)")
    if value_at(cfg, b + "prompts"):
        read_prompt_file(value_at(cfg, b + "prompts"), "bench.prompts")

    learned = value_at(cfg, b + "learned_path")
    if learned not in (None, AUTO) and not Path(learned).expanduser().is_file():
        raise ConfigError(f"bench.learned_path={learned!r}: no such file; pass the learned_tree.yaml that "
                          f"`python -m treedec.calibrate` wrote (auto: the tree shipped for the bundled head; "
                          f"null: skip the `learned` method)")
    assistant = value_at(cfg, b + "assistant_path")
    if assistant not in (None, AUTO, ASSISTANT) and not Path(assistant).expanduser().is_dir():
        raise ConfigError(f"bench.assistant_path={assistant!r} is not a model directory (auto: {ASSISTANT} "
                          f"for the bundled target; null: skip hf_assisted)")
    trees = value_at(cfg, b + "trees") or {}
    for name in trees:
        validate_tree(trees[name], f"bench.trees.{name}", "bench")
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

    heads = value_at(cfg, b + "draft_heads")
    if heads is not None:
        if not heads:
            raise ConfigError("bench.draft_heads=[]: list at least one head (or null: the draft group's head)")
        seen: dict[str, str] = {}
        for entry in heads:
            short, file = draft_head_entry(str(entry))
            if file is None and not (Path(str(entry)).expanduser().is_dir() or (ASSETS / str(entry)).is_dir()):
                names = sorted(p.stem for p in (CONF / "draft").glob("*.yaml") if p.stem != "path")
                raise ConfigError(f"bench.draft_heads names {entry!r}: neither a draft config ({', '.join(names)}) "
                                  f"nor a head directory. {unknown_key_hint(str(entry), names, label='Draft configs')}")
            if short in seen:
                raise ConfigError(f"bench.draft_heads: {seen[short]!r} and {entry!r} both go by {short!r} (a row is "
                                  f"named METHOD@{short}); give one head another directory name")
            seen[short] = str(entry)

    for name in value_at(cfg, b + "peers") or []:
        if name not in PEERS:
            raise ConfigError(f"bench.peers names {name!r}. {unknown_key_hint(name, PEERS, label='Peers')}")
    k = value_at(cfg, b + "vllm_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ConfigError(f"bench.vllm_tokens={k!r}: the tokens vLLM's speculative peers draft per step, an integer >= 1")


def draft_head_entry(entry: str) -> tuple[str, Path | None]:
    """One ``bench.draft_heads`` entry -> (its short name, its draft config file, or None for a head directory or
    bundled head name): ``tiny_code`` -> ("tiny_code", conf/draft/tiny_code.yaml); ``/heads/mine`` -> ("mine", None)."""
    file = CONF / "draft" / f"{entry}.yaml"
    if entry != "path" and file.is_file():
        return entry, file
    return Path(entry).expanduser().name or entry, None


__all__ = ["PEERS", "check_bench", "draft_head_entry"]
