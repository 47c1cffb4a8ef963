"""``jaxdist.train_cli`` is ``jaxdist.training.cli`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.train_cli")
