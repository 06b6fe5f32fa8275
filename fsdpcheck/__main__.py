import sys

from fsdpcheck.cli import main

sys.exit(main())
