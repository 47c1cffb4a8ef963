"""Root conftest: every test and doctest sees 8 simulated CPU devices.

This must run before anything starts JAX's backend, hence here and not in tests/.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

# A deprecated path's stub module warns when imported (a DeprecationWarning, an error in this
# suite): the doctest collector must not import it. tests/test_layout.py imports every moved path.
collect_ignore = ["jaxdist/launch/memstate.py", "jaxdist/launch/slot_files.py"]
