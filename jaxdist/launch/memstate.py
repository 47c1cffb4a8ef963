"""``jaxdist.launch.memstate`` is ``jaxdist.checkpoint.memstate`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.launch.memstate")
