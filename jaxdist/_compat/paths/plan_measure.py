"""``jaxdist.plan_measure`` is ``jaxdist.plan.measure`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.plan_measure")
