"""`python -m jitattn`: the same command line as the `jitattn` script."""
import sys

from jitattn.cli import main

sys.exit(main())
