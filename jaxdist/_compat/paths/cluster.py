"""``jaxdist.cluster`` is ``jaxdist.launch.cluster`` (a permanent public name)."""

from jaxdist._compat import alias

alias("jaxdist.cluster")
