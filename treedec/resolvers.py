"""OmegaConf resolvers the bundled configs use (registered when ``treedec`` is imported, before any config resolves).

``${treedec.if_auto:VALUE,A,B}`` is A when VALUE is ``auto``, else B: one config file whose defaults differ between a
fixed and an online-chosen setting (``conf/tree/dynamic.yaml``: with ``total_tokens: auto`` the pool the budget
chooses from is deeper and wider than the fixed tree, so ``tree=dynamic tree.total_tokens=auto`` alone is the tuned
auto configuration).
"""
from __future__ import annotations

from omegaconf import OmegaConf


def if_auto(value, when_auto, otherwise):
    return when_auto if str(value) == "auto" else otherwise


if not OmegaConf.has_resolver("treedec.if_auto"):
    OmegaConf.register_new_resolver("treedec.if_auto", if_auto)
