"""``jaxdist.datasets`` is ``jaxdist.input.datasets`` (a permanent public name)."""

from jaxdist._compat import alias

alias("jaxdist.datasets")
