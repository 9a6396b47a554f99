"""Deprecated: ``jaxfuse.schedule`` is ``jaxfuse.bucket_steps`` since 0.3.

The old name collided with optax's learning-rate schedules. Importing it
warns (``DeprecationWarning``) and gives the names of
``jaxfuse.bucket_steps``; removed in 0.4.
"""

import warnings

from jaxfuse.bucket_steps import *  # pylint: disable=wildcard-import,unused-wildcard-import
from jaxfuse.bucket_steps import FULL  # pylint: disable=unused-import
from jaxfuse.bucket_steps import LAYOUT_PARTS  # pylint: disable=unused-import
from jaxfuse.bucket_steps import PSUM  # pylint: disable=unused-import
from jaxfuse.bucket_steps import SPARSE  # pylint: disable=unused-import

warnings.warn(
    "jaxfuse.schedule was renamed jaxfuse.bucket_steps in jaxfuse 0.3; "
    "import it from there (from jaxfuse import bucket_steps). The old name "
    "will be removed in 0.4.", DeprecationWarning, stacklevel=2)
