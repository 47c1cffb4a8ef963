"""``jaxdist.launch.slot_files`` is ``jaxdist.checkpoint._slots`` (deprecated: removed in jaxdist 0.5.0)."""

from jaxdist._compat import alias

alias("jaxdist.launch.slot_files")
