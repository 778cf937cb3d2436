"""Every tree config instantiates to its policy, with every shipped shape."""
import pytest
from hydra.utils import instantiate

from tests.helpers import compose_config
from treedec.tree.policies import ChainPolicy, DynamicPolicy, StaticPolicy
from treedec.tree.shapes import SHAPE_DIR, list_shapes

TREE_DIR = SHAPE_DIR.parent


@pytest.mark.parametrize("name,cls", [("static", StaticPolicy), ("dynamic", DynamicPolicy), ("chain", ChainPolicy)])
def test_tree_config_instantiates(name, cls):
    cfg = compose_config(name, config_dir=TREE_DIR)
    assert isinstance(instantiate(cfg), cls)


@pytest.mark.parametrize("shape", list_shapes())
def test_static_config_takes_every_shape(shape):
    cfg = compose_config("static", [f"shape={shape}"], config_dir=TREE_DIR)
    pol = instantiate(cfg)
    assert pol.shape.to_choices() == [list(c) for c in sorted(map(tuple, cfg.shape.choices), key=lambda c: (len(c), c))]
