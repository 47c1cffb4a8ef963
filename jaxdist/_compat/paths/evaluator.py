"""``jaxdist.evaluator`` is ``jaxdist.checkpoint.evaluator`` (a permanent public name)."""

from jaxdist._compat import alias

alias("jaxdist.evaluator")
