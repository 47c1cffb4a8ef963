"""``jaxdist.elastic`` is ``jaxdist.launch.elastic`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.elastic")
