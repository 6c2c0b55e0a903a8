"""The shared test helpers live in :mod:`dcn_cupy.testing`; this name stays for tests that
import them as ``from cases import ...``."""

from dcn_cupy.testing import *  # noqa: F401,F403
from dcn_cupy.testing import __all__  # noqa: F401
