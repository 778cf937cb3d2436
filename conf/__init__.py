"""treedec's Hydra configs, shipped as the package ``treedec.conf`` (pyproject's package-dir maps it to conf/).

Entry points find them as ``config_path="pkg://treedec.conf"``; ``treedec.models.paths.CONF`` is this directory.
"""
