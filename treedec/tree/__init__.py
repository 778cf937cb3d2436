"""Draft trees: construction, validation, layout (masks, positions, paths) and shape policies."""
from treedec.attention.layout import ancestor_matrix, chain_bits, pack_bits, unpack_bits
from treedec.tree.tree import Tree, TreeError

__all__ = ["Tree", "TreeError", "ancestor_matrix", "chain_bits", "pack_bits", "unpack_bits"]
