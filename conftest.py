"""Root conftest: every test and doctest sees 8 simulated CPU devices.

This must run before anything starts JAX's backend, hence here and not in tests/.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)
