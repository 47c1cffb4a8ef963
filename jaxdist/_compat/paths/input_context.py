"""``jaxdist.input_context`` is ``jaxdist.input.context`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.input_context")
