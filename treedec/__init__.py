"""treedec: tree speculative decoding (see README.md)."""
from treedec import resolvers  # noqa: F401  (registers the configs' OmegaConf resolvers)
