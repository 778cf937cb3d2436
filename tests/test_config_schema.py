"""Every config group option composes, validates against the schemas and instantiates; typos are clear errors."""
from __future__ import annotations

import pytest
from hydra.core.config_store import ConfigStore
from hydra.utils import instantiate
from omegaconf import OmegaConf

import treedec.config as checks
import treedec.config.schema as schema
from tests.helpers import compose_config
from treedec.sampling import SamplingParams
from treedec.tree.policies import AutoPolicy, ChainPolicy, DynamicPolicy, LearnedPolicy, LookupPolicy, StaticPolicy
from treedec.tree.policies.best_first import BestFirstPolicy
from treedec.tree.policies.learned import save_learned
from treedec.tree.shapes import SHAPE_DIR, list_shapes

CONF = SHAPE_DIR.parents[1]
GROUPS = ("tree", "sampling", "kernel", "model", "draft")
OPTIONS = {g: sorted(p.stem for p in (CONF / g).glob("*.yaml")) for g in GROUPS}
POLICY = {"static": StaticPolicy, "dynamic": DynamicPolicy, "chain": ChainPolicy, "learned": LearnedPolicy,
          "dynamic_sample": DynamicPolicy, "lookup": LookupPolicy, "auto": AutoPolicy,
          "best_first": BestFirstPolicy}


@pytest.fixture(scope="module")
def learned_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("learned") / "learned_tree.yaml"
    return save_learned(path, [[0], [1], [0, 0]], {"name": "t4", "budget": 4}, {2: [[0]], 4: [[0], [1], [0, 0]]})


def gen(overrides=(), name="generate"):
    return compose_config(name, overrides)


def test_group_options_exist():
    assert set(OPTIONS["tree"]) == set(POLICY)
    assert {"greedy", "sample"} <= set(OPTIONS["sampling"]) and set(OPTIONS["kernel"]) == set(schema.KERNEL_BACKENDS)


def test_schemas_registered():
    repo = ConfigStore.instance().repo
    assert {"generate.yaml", "calibrate.yaml", "bench.yaml", "model.yaml", "draft.yaml"} <= set(repo["schema"])
    assert {"static.yaml", "dynamic.yaml", "chain.yaml", "learned.yaml", "auto.yaml", "shape.yaml"} <= set(
        repo["schema"]["tree"])


@pytest.mark.parametrize("tree", OPTIONS["tree"])
def test_every_tree_option_composes_validates_instantiates(tree, learned_file):
    extra = [f"tree.path={learned_file}"] if tree == "learned" else []
    cfg = gen([f"tree={tree}", *extra])
    checks.validate(cfg, "generate")
    assert isinstance(instantiate(cfg.tree), POLICY[tree])


@pytest.mark.parametrize("shape", list_shapes())
def test_every_shape_validates(shape):
    cfg = gen(["tree=static", f"tree/shape={shape}"])
    checks.validate(cfg, "generate")
    assert len(instantiate(cfg.tree).shape) == len(cfg.tree.shape.choices) + 1


@pytest.mark.parametrize("group", ["sampling", "kernel", "model", "draft"])
def test_every_other_option_composes_and_validates(group):
    for option in OPTIONS[group]:
        extra = [f"{group}.path=/some/dir"] if option in ("hf", "path") else []
        for entry in ("generate", "calibrate", "bench"):
            cfg = gen([f"{group}={option}", *extra], entry)
            checks.validate(cfg, entry)
            if group == "sampling":
                assert isinstance(instantiate(cfg.sampling), SamplingParams)
            if group == "kernel":  # kernel=NAME sets the target's attention backend
                assert cfg.model.attn_backend == option and "kernel" not in cfg
            if group in ("model", "draft"):  # each names its loader
                assert cfg[group]._target_ in ("treedec.models.load_model", "treedec.heads.load_head")


def test_calibrate_config_probe_instantiates():
    cfg = gen([], "calibrate")
    checks.validate(cfg, "calibrate")
    probe = instantiate(cfg.probe)
    assert isinstance(probe, StaticPolicy) and probe.max_depth == cfg.probe.depth
    assert OmegaConf.to_container(cfg, resolve=False)["out"] == "${paths.run_dir}/learned_tree.yaml"


@pytest.mark.parametrize("override,needle", [
    ("max_new_tokens=lots", "max_new_tokens"),  # wrong type (compose time, the schema is registered)
    ("sampling.temperature=hot", "temperature"),
    ("tree.totl_tokens=8", "totl_tokens"),  # Hydra's struct mode
])
def test_compose_time_errors(override, needle):
    with pytest.raises(Exception, match=needle):
        gen([override])


@pytest.mark.parametrize("override,needle", [
    ("tree=dynamic|+tree.totl_tokens=8", "tree.totl_tokens"),
    ("tree=dynamic|tree.total_tokens=many", "tree.total_tokens"),
    ("+seeed=1", "seeed"),
    ("model.attn_backend=cudnn", "model.attn_backend"),
    ("tree=static|+tree.shape.choicez=[[0]]", "tree.shape.choicez"),
])
def test_validate_errors_name_the_key(override, needle):
    cfg = gen(override.split("|"))
    with pytest.raises(checks.ConfigError, match=needle.replace(".", r"\.")):
        checks.validate(cfg, "generate")


def test_optuna_search_composes():
    """The Optuna sweep (conf/hparams_search/optuna_tree.yaml; the optuna extra, a test dependency) composes."""
    cfg = compose_config("generate", ["hparams_search=optuna_tree"], hydra=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper") and cfg.optimized_metric == "tokens_per_s"
    assert set(cfg.hydra.sweeper.params) == {"tree.total_tokens", "tree.depth", "tree.top_k"}
    checks.validate(cfg, "generate")


def test_bench_config_validates_and_rejects_wrong_types():
    """conf/bench.yaml composes against schema/bench; a wrong type fails while composing, an appended typo in validate."""

    checks.validate(gen([], "bench"), "bench")
    with pytest.raises(Exception, match="bench.repeats"):
        gen(["bench.repeats=many"], "bench")
    with pytest.raises(checks.ConfigError, match=r"Did you mean bench\.trees\.chain\.depth\?"):
        checks.validate(gen(["+bench.trees.chain.dept=3"], "bench"), "bench")


def test_tree_schemas_are_looked_up_by_class():
    """Every import path of a policy class finds its schema; a target of your own, or one that does not import, none."""
    for path in ("treedec.tree.policies.StaticPolicy", "treedec.tree.policies.static.StaticPolicy"):
        assert schema.tree_schema(path) is schema.StaticTreeSchema
    assert schema.tree_schema("treedec.tree.policies.dynamic.DynamicPolicy") is schema.DynamicTreeSchema
    assert schema.tree_schema("tests.helpers.make_pair") is None and schema.tree_schema("no.such.Policy") is None
    assert all(schema.tree_schema(key) is cls for key, cls in schema.TREE_SCHEMAS.items())  # no stale class name


def test_the_layer_refuses_a_dynamic_tree_by_the_policys_own_rule_before_anything_is_built():
    """A tree the policy cannot build is refused by ``validate`` (before any model loads), with the message the
    policy's constructor gives a Python caller: one rule (``DynamicPolicy.check_sizes``), not a copy of it."""
    from treedec.tree.tree import TreeError

    bad = {"total_tokens": 16, "depth": 4, "top_k": 2}
    with pytest.raises(TreeError) as direct:
        DynamicPolicy(**bad)
    with pytest.raises(checks.ConfigError) as layer:
        checks.validate(gen(["tree=dynamic", *(f"tree.{k}={v}" for k, v in bad.items())]), "generate")
    assert str(layer.value) == f"invalid tree config: {direct.value}"
    with pytest.raises(checks.ConfigError, match=r"invalid bench\.trees\.dynamic config: tree\.total_tokens=auto is "
                                                 r"now its own policy"):
        checks.validate(gen(["bench.trees.dynamic.total_tokens=auto"], "bench"), "bench")


def _raised_messages(path):
    """(line, the constant text of the message) of each ``raise X("...")`` in a module (f-string holes as {})."""
    import ast

    def text(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.JoinedStr):
            return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        return None

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            msg = text(node.exc.args[0])
            if msg:
                yield node.lineno, msg


def test_a_config_rule_is_written_once():
    """Config validation lives in treedec/config/: no message it raises shares a 40-character run with a message
    raised anywhere else in treedec/ (a second copy of a rule, in a policy, a loader or the bench, would)."""
    import difflib
    from pathlib import Path

    root = Path(checks.__file__).resolve().parents[1]
    layer = {f"{p.name}:{n}": m for p in (root / "config").glob("*.py") for n, m in _raised_messages(p)}
    rest = {f"{p.relative_to(root)}:{n}": m for p in root.rglob("*.py") if p.parent.name != "config"
            for n, m in _raised_messages(p)}
    assert len(layer) > 50 and len(rest) > 100
    copies = []
    for where, msg in layer.items():
        for other, text in rest.items():
            match = difflib.SequenceMatcher(None, msg, text, autojunk=False).find_longest_match(0, len(msg), 0, len(text))
            if match.size >= 40:
                copies.append((where, other, msg[match.a:match.a + match.size]))
    assert copies == []
