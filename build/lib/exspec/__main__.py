"""`python -m exspec`: the same as the `exspec` command."""

import sys

from exspec.cli.main import main

sys.exit(main())
