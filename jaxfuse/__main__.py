"""``python -m jaxfuse``: the ``jaxfuse`` command (see
``jaxfuse.planning.cli``)."""

import sys

from jaxfuse.planning.cli import main

sys.exit(main())
