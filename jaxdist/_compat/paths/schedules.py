"""``jaxdist.schedules`` is ``jaxdist.training.schedules`` (a permanent public name)."""

from jaxdist._compat import alias

alias("jaxdist.schedules")
