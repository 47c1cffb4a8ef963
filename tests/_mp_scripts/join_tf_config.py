"""Joins the job TF_CONFIG describes with `jaxdist.initialize(timeout_s=SECONDS)`.

Usage: `join_tf_config.py SECONDS`."""
import sys

import jaxdist

jaxdist.initialize(timeout_s=float(sys.argv[1]))
print("joined (unexpected)")
