"""``jaxdist.memstate`` is ``jaxdist.checkpoint.memstate`` (a permanent public name)."""

from jaxdist._compat import alias

alias("jaxdist.memstate")
