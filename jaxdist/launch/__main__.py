"""``python -m jaxdist.launch``: the same as ``jaxdist launch``."""

import sys

from jaxdist.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())
