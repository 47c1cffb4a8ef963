"""``jaxdist.launch_group`` is ``jaxdist.launch.group`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.launch_group")
