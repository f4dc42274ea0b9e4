"""PopTorch 3.x on a simulated IPU Model built from PyTorch's own compiler stack.

``import poptorch`` gives the PopTorch 3.4 public API (docs/api-sections.md api §1): wrap a module
with :func:`trainingModel` or :func:`inferenceModel`, configure with :class:`Options`, feed it with
:class:`DataLoader`. Programs run unchanged on any machine: the "device" is an IPU Model that
executes the captured graph with PyTorch kernels.
"""
import faulthandler as _faulthandler

from poptorch._compat.release import __version__  # noqa: E402

import torch as _torch  # noqa: E402

from popart_compiler.cost.ipu_model import MAX_IPUS as _MAX_IPUS  # noqa: E402
from popart_compiler.errors import Error, RecoverableError, UnrecoverableError  # noqa: E402

from poptorch._options import environment as _environment  # noqa: E402

_environment.set_process_defaults()
from poptorch import enums  # noqa: E402
from poptorch.enums import *  # noqa: E402,F401,F403
from poptorch._logging import logger, setLogLevel  # noqa: E402,F401
from poptorch._capture.custom_parsers import (  # noqa: E402,F401
    ICustomArgParser, registerCustomArgParser)
from poptorch._impl import isRunningOnIpu  # noqa: E402,F401
from poptorch._options.execution_strategy import *  # noqa: E402,F401,F403
from poptorch.options import *  # noqa: E402,F401,F403
from poptorch.ops import *  # noqa: E402,F401,F403
from poptorch._ops.printing import *  # noqa: E402,F401,F403
from poptorch._capture.capture import (  # noqa: E402,F401
    registerPostCompileHook, registerPreCompileHook)
from poptorch._executor import wrapping as _wrapping  # noqa: E402
from poptorch._executor.executor import PoplarExecutor  # noqa: E402
from poptorch._files import export as _export  # noqa: E402
from poptorch import optim  # noqa: E402,F401
from poptorch import profiling  # noqa: E402,F401
from poptorch import plan  # noqa: E402,F401  (callable: poptorch.plan(model, ...))
from poptorch._data.dataloader import DataLoader, AsynchronousDataAccessor  # noqa: E402,F401
from poptorch import poptorch_core  # noqa: E402,F401
from poptorch import options, ops  # noqa: E402,F401


def trainingModel(model: _torch.nn.Module, options: "Options" = None,
                  optimizer: _torch.optim.Optimizer = None) -> PoplarExecutor:
    """Wrap ``model`` for training on the IPU (docs/api-sections.md api §2.1).

    Args:
        model: a ``torch.nn.Module`` or an existing :class:`PoplarExecutor` (its user
            model is used). Its ``forward`` must return the loss (docs/semantics.md S-40).
        options: :class:`Options` (default: a fresh ``Options()``). The object passed is
            frozen; the executor keeps a clone. Default output mode: ``Final``.
        optimizer: a supported optimizer (docs/semantics.md S-50); default
            ``poptorch.optim.SGD(lr=0.01)``.

    Returns:
        A :class:`PoplarExecutor`; nothing is compiled until the first call or
        ``compile()``. The model is instrumented so that reading its weights on the host
        pulls the trained values from the device (docs/api-sections.md api §6).

    Raises:
        RuntimeError: the model is already wrapped by a live training executor.
        poptorch.Error: ``options`` is not an ``Options``; a buffer is not a plain
            ``torch.Tensor``.
        AssertionError / ValueError: unsupported optimizer.
    """
    return _wrapping.wrap(model, options, True, optimizer=optimizer)


def inferenceModel(model: _torch.nn.Module, options: "Options" = None) -> PoplarExecutor:
    """Wrap ``model`` for inference on the IPU (docs/api-sections.md api §2.2).

    Args:
        model: a ``torch.nn.Module`` or an existing :class:`PoplarExecutor`.
        options: :class:`Options` (default: a fresh ``Options()``); frozen, cloned.
            Default output mode: ``All``.

    Returns:
        A :class:`PoplarExecutor` (compiled on the first call or ``compile()``).

    Raises:
        poptorch.Error: ``options`` is not an ``Options``; gradient accumulation is not 1.
    """
    return _wrapping.wrap(model, options, False)


def load(filename: str, edit_opts_fn=None, *, unpickle_model: bool = False
         ) -> PoplarExecutor:
    """Rebuild a model saved with ``PoplarExecutor.save()`` /
    ``compileAndExport(..., export_model=True)`` and load its executable (docs/api-sections.md api
    §2.3, docs/semantics.md S-62): options (with ``ConnectionType.Never`` and the offline IPU
    version removed, then ``edit_opts_fn(options)``), model weights, optimizer with its state,
    executable and RNG state. A loaded training model continues exactly where the saved one stopped.

    Args:
        filename: the file (format in ``docs/executables.md``).
        edit_opts_fn: called with the stored ``Options`` before wrapping (only
            run-time options such as the device may change).
        unpickle_model: rebuild the original Python model from its pickle stored in
            the file (runs code from the file: only for files you trust). By default
            nothing is unpickled: the model is an :class:`poptorch._files.export.ExportedModel`
            holding the stored weights, and the stored program runs without the
            model's Python source.

    Returns:
        A compiled :class:`PoplarExecutor`. Exported models are not connected to
        other wrappers: move weights between them explicitly (docs/semantics.md S-62).

    Raises:
        poptorch.Error: unreadable, truncated or corrupted file, another format
            version, no pickled model with ``unpickle_model=True``.
        AssertionError: another PopTorch version; a file saved with
            ``export_model=False`` (use ``loadExecutable``).
    """
    return _wrapping.wrap_loaded(_export.read_exported(filename, __version__, edit_opts_fn,
                                                       unpickle_model))


def importPoptorchMetadataFromFile(filename: str) -> bytes:
    """The metadata blob (``metadata.json``, UTF-8 JSON) of an exported file
    (docs/api-sections.md api §2.13).

    Raises:
        poptorch.Error: not an executable file, or no metadata in it.
    """
    return _export.import_metadata(filename)


#: IPU architecture version of each IPU Model version (``POPTORCH_IPU_MODEL_VERSION``).
_ARCH_VERSIONS = {"ipu1": 1, "ipu2": 2, "ipu21": 21}


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """Whether physical IPUs are present (docs/api-sections.md api §2.5).

    Always ``False`` by default: the IPU Model is the device. Frameworks that refuse to
    start without hardware (lightning-graphcore's ``IPUAccelerator``) can be run on the
    simulator by setting the environment variable ``POPTORCH_IPU_MODEL_AS_HARDWARE=1``
    before they import PopTorch: the IPU Model's IPUs (up to 64) are then reported as
    present.

    Args:
        num_ipus: IPUs needed.
    """
    if not _environment.ipu_model_as_hardware():
        return False
    return 1 <= num_ipus <= _MAX_IPUS


def ipuHardwareVersion() -> int:
    """The IPU architecture version of the hardware (docs/api-sections.md api §2.6).

    With ``POPTORCH_IPU_MODEL_AS_HARDWARE=1``: the IPU Model's version
    (``POPTORCH_IPU_MODEL_VERSION``: 1 for ``ipu1``, 2 for ``ipu2``, the default, 21
    for ``ipu21``; -1 with a warning if unrecognised).

    Raises:
        AssertionError: "No IPU hardware available on this system" (without the
            opt-in: there is no physical IPU).
    """
    if not _environment.ipu_model_as_hardware():
        raise AssertionError("No IPU hardware available on this system")
    name = _environment.ipu_model_version()
    if name not in _ARCH_VERSIONS:
        logger.warning("Unknown IPU architecture %s", name)
        return -1
    return _ARCH_VERSIONS[name]


_faulthandler.enable()
if not _torch.__version__.startswith("2.13"):
    logger.warning("poptorch %s was tested with torch 2.13; found torch %s",
                   __version__, _torch.__version__)
