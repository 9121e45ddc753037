"""``python -m flowreduce ...`` is the ``flowreduce`` command."""

import sys

from flowreduce.cli import main

sys.exit(main())
