"""Tree-shape policies: static (fixed shape), chain, dynamic (EAGLE-2), learned (Sequoia), best-first (DDTree, from a
one-pass head's marginals), auto (sized per step by this machine's costs), and prompt lookup beside any."""
from treedec.tree.policies.auto import AutoPolicy
from treedec.tree.policies.base import TreePolicy
from treedec.tree.policies.best_first import BestFirstPolicy
from treedec.tree.policies.chain import ChainPolicy
from treedec.tree.policies.dynamic import DynamicPolicy
from treedec.tree.policies.learned import LearnedPolicy
from treedec.tree.policies.lookup import LookupPolicy
from treedec.tree.policies.static import StaticPolicy

__all__ = ["AutoPolicy", "BestFirstPolicy", "ChainPolicy", "DynamicPolicy", "LearnedPolicy", "LookupPolicy", "StaticPolicy", "TreePolicy"]
