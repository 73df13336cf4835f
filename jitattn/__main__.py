import sys

from jitattn.cli import main

sys.exit(main())
