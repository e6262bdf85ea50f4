import sys

from kvslim.cli import main

sys.exit(main())
