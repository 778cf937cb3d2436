"""Every tree config instantiates to its policy, with every shipped shape."""
import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from treedec.tree.policies import ChainPolicy, DynamicPolicy, StaticPolicy
from treedec.tree.shapes import SHAPE_DIR, list_shapes

TREE_DIR = str(SHAPE_DIR.parent)


@pytest.mark.parametrize("name,cls", [("static", StaticPolicy), ("dynamic", DynamicPolicy), ("chain", ChainPolicy)])
def test_tree_config_instantiates(name, cls):
    with initialize_config_dir(config_dir=TREE_DIR, version_base="1.3"):
        cfg = compose(config_name=name)
    assert isinstance(instantiate(cfg), cls)


@pytest.mark.parametrize("shape", list_shapes())
def test_static_config_takes_every_shape(shape):
    with initialize_config_dir(config_dir=TREE_DIR, version_base="1.3"):
        cfg = compose(config_name="static", overrides=[f"shape={shape}"])
    pol = instantiate(cfg)
    assert pol.shape.to_choices() == [list(c) for c in sorted(map(tuple, cfg.shape.choices), key=lambda c: (len(c), c))]
