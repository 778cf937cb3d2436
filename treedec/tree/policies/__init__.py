"""Tree-shape policies: static (fixed shape), chain, dynamic (EAGLE-2)."""
from treedec.tree.policies.base import DraftTree, TreePolicy
from treedec.tree.policies.dynamic import DynamicPolicy
from treedec.tree.policies.learned import LearnedPolicy
from treedec.tree.policies.static import ChainPolicy, StaticPolicy

__all__ = ["ChainPolicy", "DraftTree", "DynamicPolicy", "LearnedPolicy", "StaticPolicy", "TreePolicy"]
