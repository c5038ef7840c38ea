"""``python -m zserve.loadgen.experiments NAME``: the same as ``zserve experiment NAME``."""

import sys

from zserve.loadgen.experiments.runner import main

sys.exit(main(sys.argv[1:]))
