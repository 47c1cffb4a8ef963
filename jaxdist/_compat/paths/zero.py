"""``jaxdist.zero`` is ``jaxdist.core.zero`` (a permanent public name)."""

from jaxdist._compat import alias

alias("jaxdist.zero")
