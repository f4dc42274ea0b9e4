"""The PopTorch release this package reproduces (``poptorch.__version__``)."""

__version__ = "3.4.0"
