"""``tree=auto``: the policy (policy.py), its step-cost table (cost.py) and the profiler that fills it (profile.py)."""
from treedec.tree.policies.auto.policy import AutoPolicy

__all__ = ["AutoPolicy"]
