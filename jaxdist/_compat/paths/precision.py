"""``jaxdist.precision`` is ``jaxdist.training.precision`` (a permanent public name)."""

from jaxdist._compat import alias

alias("jaxdist.precision")
