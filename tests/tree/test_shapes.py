"""Shipped static tree shapes (conf/tree/shape) and the shape loader."""
from __future__ import annotations

import json
import math

import pytest
import torch

from treedec.tree import Tree, TreeError
from treedec.tree.shapes import SHAPE_DIR, list_shapes, load_shape

# name -> (tree size incl. root, max depth, number of root children, number of leaves)
SHIPPED = {
    "eagle_mc_sim_7b_63": (26, 5, 4, 15),
    "medusa_mc_sim_7b_63": (64, 4, 10, 42),
    "chain_5": (6, 5, 1, 1),
    "balanced_2x3": (15, 3, 2, 8),
}


def test_list_shapes_has_the_shipped_ones():
    names = list_shapes()
    assert names == sorted(names)
    assert set(SHIPPED) <= set(names)


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_shape_builds(name):
    size, max_depth, n_root_children, n_leaves = SHIPPED[name]
    choices = load_shape(name)
    assert all(isinstance(c, list) and all(type(x) is int for x in c) for c in choices)
    t = Tree.from_choices(choices)
    assert len(t) == size == len(choices) + 1
    assert t.max_depth == max_depth
    assert len(t.children()[0]) == n_root_children
    assert len(t.leaves()) == n_leaves
    p = t.parents.tolist()
    assert p[0] == -1 and all(0 <= p[i] < i for i in range(1, len(p)))  # topological
    assert {tuple(c) for c in t.to_choices()} == {tuple(c) for c in choices}
    assert len({tuple(c) for c in choices}) == len(choices)  # no duplicates
    bits = t.ancestor_bits()
    assert bits.shape == (size, math.ceil(size / 64)) and bits.dtype == torch.int64
    # each row holds exactly depth + 1 set bits (itself and its ancestors)
    counts = [sum(bin(w & ((1 << 64) - 1)).count("1") for w in row) for row in bits.tolist()]
    assert counts == [d + 1 for d in t.depth.tolist()]


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_file_header_and_name(name):
    path = SHAPE_DIR / f"{name}.yaml"
    text = path.read_text()
    assert text.startswith("#")
    assert "Source:" in text
    from omegaconf import OmegaConf

    assert OmegaConf.load(path).name == name
    assert load_shape(path) == load_shape(name) == load_shape(str(path)) == load_shape(f"{name}.yaml")


def test_eagle_default_tree_exact():
    # EAGLE (SafeAILab/EAGLE, eagle/model/choices.py, mc_sim_7b_63)
    assert load_shape("eagle_mc_sim_7b_63") == [
        [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
        [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1],
    ]  # fmt: skip


def test_medusa_tree_facts():
    ch = load_shape("medusa_mc_sim_7b_63")
    assert len(ch) == 63
    assert ch[:6] == [[0], [0, 0], [1], [0, 1], [2], [0, 0, 0]]  # source order is kept
    assert ch[-1] == [0, 7, 0]
    assert sorted(c[0] for c in ch if len(c) == 1) == list(range(10))
    assert [sum(1 for c in ch if len(c) == k) for k in (1, 2, 3, 4)] == [10, 28, 23, 2]
    # T = 64 exactly: the last node's row uses the sign bit of the single word
    t = Tree.from_choices(ch)
    assert t.ancestor_bits().shape == (64, 1)
    assert t.ancestor_bits()[63, 0].item() < 0
    assert t.ancestor_bits()[:63, 0].ge(0).all()


def test_chain_and_balanced_exact():
    assert load_shape("chain_5") == [[0] * k for k in range(1, 6)]
    assert Tree.from_choices(load_shape("chain_5")).parents.tolist() == Tree.chain(6).parents.tolist()
    t = Tree.from_choices(load_shape("balanced_2x3"))
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert all(len(c) == 2 for c in t.children()[:7]) and all(not c for c in t.children()[7:])


def test_load_user_yaml_and_json(tmp_path):
    y = tmp_path / "mine.yaml"
    y.write_text("# a user shape\nchoices: [[0], [1], [0, 0]]\n")
    assert load_shape(y) == [[0], [1], [0, 0]]
    assert load_shape(str(y)) == [[0], [1], [0, 0]]
    j = tmp_path / "mine.json"
    j.write_text(json.dumps({"name": "x", "choices": [[0], [0, 0], [0, 0, 0]]}))
    assert load_shape(j) == [[0], [0, 0], [0, 0, 0]]
    assert len(Tree.from_choices(load_shape(j))) == 4


def test_unknown_name_lists_shipped_shapes():
    with pytest.raises(TreeError) as ei:
        load_shape("no_such_shape")
    msg = str(ei.value)
    assert "no_such_shape" in msg
    for name in SHIPPED:
        assert name in msg
    assert isinstance(ei.value, ValueError)


def test_missing_file_path_is_an_error(tmp_path):
    with pytest.raises(TreeError, match="unknown tree shape"):
        load_shape(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    "text,word",
    [
        ("name: x\n", "choices"),
        ("- [0]\n- [1]\n", "choices"),  # a bare list, not a mapping
        ("choices: 3\n", "list"),
        ("choices: [[0], [a]]\n", "integer"),
        ("choices: [0, 1]\n", "integer"),
        ("choices: [[0], [true]]\n", "integer"),
    ],
)
def test_bad_shape_files(tmp_path, text, word):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(TreeError, match=word):
        load_shape(f)
