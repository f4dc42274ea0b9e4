"""PopTorch's private names that its clients and its own tests import.

PopTorch programs and frameworks built on PopTorch (optimum-graphcore, PopTorch
Geometric, Lightning) reach into ``poptorch._impl``, ``poptorch.poptorch_core``,
``poptorch._utils`` and ``poptorch._poplar_executor``. Those top-level modules stay
thin shims; the behaviour behind the names lives here:

* :mod:`.wrapping`: the wrapped (instrumented) parameters and buffers of a model
  (``isWrapped``, ``unwrapModelIfNecessary``, ``rewrapModelIfNecessary``, ...).
* :mod:`.error_hooks`: ``TestErrorType`` and ``_throwTestError``, which raise each
  kind of PopTorch error (Graphcore's ``error_handling.py`` uses them).
* :mod:`.tensor_structures`: ``combine_batch_tensors_gen`` and the helpers around it.
* :mod:`.release`: the PopTorch release this package reproduces (``poptorch.__version__``).
"""
