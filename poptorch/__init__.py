"""PopTorch 3.x on a simulated IPU Model (work in progress: this file is extended as the
package grows)."""
import os as _os

_os.environ.setdefault("RDMAV_FORK_SAFE", "1")

__version__ = "3.4.0"

from popart_compiler.errors import Error, RecoverableError, UnrecoverableError  # noqa: E402
from .enums import *  # noqa: E402,F401,F403
from ._logging import logger, setLogLevel  # noqa: E402,F401
from ._custom_parsers import ICustomArgParser, registerCustomArgParser  # noqa: E402,F401
