import sys

from heron.server.cli import main

sys.exit(main())
