"""``jaxdist.per_replica`` is ``jaxdist.core.per_replica`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.per_replica")
