"""``python -m jaxfuse``: the ``jaxfuse`` command (see ``jaxfuse.cli``)."""

import sys

from jaxfuse.cli import main

sys.exit(main())
