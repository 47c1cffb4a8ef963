import jax

# Eight simulated CPU devices; must run before the JAX backend starts.
jax.config.update("jax_num_cpu_devices", 8)
