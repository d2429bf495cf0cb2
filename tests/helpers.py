"""Moved to ``shmtransport.testing`` (the plain helpers of the pytest plugin); re-exported here so
``from helpers import ...`` keeps working. New code imports from ``shmtransport.testing``."""
from shmtransport.testing import *  # noqa: F401,F403
from shmtransport.testing import (  # noqa: F401 - names outside __all__ that tests used
    DEFAULT_CHILD_TIMEOUT_S,
    SPAWN,
)
