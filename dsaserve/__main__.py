import sys

from dsaserve.cli import main

sys.exit(main())
