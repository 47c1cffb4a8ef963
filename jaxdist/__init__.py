"""jaxdist: tf.distribute-style distribution strategies for JAX."""
