"""``jaxdist.models`` is ``jaxdist.training.models`` (a permanent public name)."""

from jaxdist._compat import alias

alias("jaxdist.models")
