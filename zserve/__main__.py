import sys

from zserve.cli import main

sys.exit(main())
