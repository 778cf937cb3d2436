"""treedec: tree speculative decoding (see README.md)."""
