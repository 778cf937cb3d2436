"""Tree-shape policies: static (fixed shape), chain, dynamic (EAGLE-2), learned (Sequoia)."""
from treedec.tree.policies.base import TreePolicy
from treedec.tree.policies.dynamic import DynamicPolicy
from treedec.tree.policies.learned import LearnedPolicy
from treedec.tree.policies.static import ChainPolicy, StaticPolicy

__all__ = ["ChainPolicy", "DynamicPolicy", "LearnedPolicy", "StaticPolicy", "TreePolicy"]
