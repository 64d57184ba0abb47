import sys

from portagrpo.cli import main

sys.exit(main())
