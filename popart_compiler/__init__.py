"""popart_compiler: the compiler and runtime of the simulated IPU (our PopART).

It never imports ``poptorch``. Graph in (a ``torch.export`` program), outputs out.
"""
from popart_compiler.errors import Error, RecoverableError, UnrecoverableError  # noqa: F401
