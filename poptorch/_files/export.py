"""Precompiled executables: ``save`` / ``compileAndExport``, ``loadExecutable``,
``poptorch.load`` and ``importPoptorchMetadataFromFile`` (docs/api-sections.md api §2.3, §2.13,
§5.4-§5.6; docs/semantics.md S-62, S-81, S-96). The file format is described in
:mod:`poptorch._files.container`.

``metadata.json`` holds the ``poptorch`` / ``torch`` versions, the training flag,
whether the model was exported, the executor's ``Options`` (tagged JSON), the
replica grouping of weights, ``forward``'s signature and, for exported models, the
weight layout (names, kinds, aliases) and the optimizer settings; the RNG state when
saved. Loading a file never unpickles anything: ``poptorch.load`` rebuilds the model
from the stored program and weights (:class:`ExportedModel`), so the model's Python
source is not needed. The pickled Python model (``model.pkl``) is only read when the
caller passes ``unpickle_model=True``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import pickle
import stat
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from popart_compiler.errors import Error, backend_error, py_error
from popart_compiler.stages import Executable
from poptorch import enums
from poptorch._executor import instrument
from poptorch._files.container import (decode, encode, kind_of, tensors_to_bytes,
                                       write_container)
from poptorch._files.exported_file import CheckedFile, check_file, read_file
from poptorch._files.optimizer_record import (device_state_of, optimizer_record,
                                              rebuild_optimizer, restore_state)
from poptorch._files.processes import PROCESS_KEYS, adopt_processes
from poptorch._files.program import Program, from_blobs, to_blobs
from poptorch._files.schema import Invalid, invalid_file
from poptorch._files.structure import decode_signature, encode_signature
from poptorch._logging import logger

__all__ = ["Saved", "Expected", "Loaded", "save", "load_executable", "read_exported",
           "import_metadata", "restore_state", "from_file", "ExportedModel"]

#: Options that may differ between the saving and the loading executor (docs/semantics.md S-62: only
#: run-time options matter after loading).
_RUNTIME_OPTIONS = frozenset({
    "connection_type", "ipu_id", "ipu_version", "use_model", "sync_pattern", "log_dir",
    "ipu_model_strict_memory",
    "max_repeat_logs", "model_name", "cachePath", "enableEngineCaching",
    "compilation_progress_bar_fn", "engineOptions"})


#: Top-level and backend options that choose where a process writes (logs, profile
#: reports and their sub-directory, the executable cache): a loaded file never sets
#: them, the loading process's own ``Options()`` (and environment) do (issue 29).
_LOCAL_OPTIONS = ("log_dir", "model_name")
_LOCAL_BACKEND_OPTIONS = ("engineOptions", "cachePath", "enableEngineCaching")


def _use_local_paths(options) -> None:
    """Replace the options of ``options`` (read from a file) that choose where this
    process writes with those of a fresh ``Options()`` of this process."""
    fresh = type(options)()
    for key in _LOCAL_OPTIONS:
        if key in fresh._values:
            options._values[key] = fresh._values[key]
        else:
            options._values.pop(key, None)
    stored, local = options._Popart.options, fresh._Popart.options
    for key in _LOCAL_BACKEND_OPTIONS:
        if key in local:
            stored[key] = local[key]
        else:
            stored.pop(key, None)


# -- saving ---------------------------------------------------------------------------

def _target_path(filename: str) -> str:
    """The regular file ``save`` writes (docs/api-sections.md api §5.5): the parent directory is
    created; ``<dir>/model.poptorch`` when ``filename`` is a directory or ends with a path separator
    (the directory is then created if needed); a symbolic link to a regular file is written through
    (the file it points to is replaced, the link kept).

    Raises:
        AssertionError: the parent of ``filename`` is not a directory (as PopTorch).
        poptorch.Error: ``filename`` is empty; ``filename`` exists and is not a
            regular file (a device such as ``/dev/null``, a FIFO, a socket) or is a
            link to one or to nothing: it is never replaced.
    """
    filename = os.fspath(filename)
    if not isinstance(filename, str) or not filename:
        raise backend_error(f"Cannot save to {filename!r}: give the path of a file (or "
                            "of a directory, to save to <dir>/model.poptorch).")
    if os.path.isdir(filename) or filename.endswith(("/", os.sep)):
        path = os.path.join(filename, "model.poptorch")
        logger.warning("save(): %s %s: saving to %s", filename, "is a directory" if
                       os.path.isdir(filename) else "ends with a path separator", path)
        filename = path
    target = os.path.realpath(filename) if os.path.islink(filename) else filename
    if os.path.lexists(filename):
        if os.path.islink(filename) and not os.path.lexists(target):
            raise backend_error(f"Cannot save to {filename}: it is a symbolic link to "
                                f"{os.readlink(filename)}, which does not exist. Remove "
                                "the link or save to another path.")
        mode = os.stat(target).st_mode
        if not stat.S_ISREG(mode):
            what = kind_of(mode)
            shown = filename if target == filename else f"{filename} (-> {target})"
            raise backend_error(f"Cannot save to {shown}: it exists and is {what}, which "
                                "save() never replaces. Save to a regular file path.")
    parent = os.path.dirname(os.path.abspath(target))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise AssertionError(f"Cannot save to {filename}: {parent} is not a directory")
    os.makedirs(parent, exist_ok=True)
    return target


@dataclasses.dataclass
class Saved:
    """What ``PoplarExecutor.save`` writes (the host weights and the optimizer state
    already synchronised with the device).

    Attributes:
        program: the compiled program (its ``blobs``, if serialized before compiling).
        recapture: captures the uncompiled program again when it has no blobs.
        executable: the compiler's product (a program with no device work is refused).
        options: the executor's ``Options``.
        training: a training executable.
        forward: the captured module's ``forward`` (its signature is stored).
        groupings: replica groupings of weights (docs/semantics.md S-27).
        version: the PopTorch version writing the file.
        model: the user's model to export (weights, layout, pickle), or ``None``
            (``export_model=False``).
        optimizer: the training optimizer to export, or ``None``.
        param_names: ``id(parameter) → name`` of the model's parameters.
        session: the session (the device state of a ``torch.optim`` optimizer).
        rng_state: the RNG state to store, or ``None``.
    """
    program: Program
    recapture: Optional[Callable[[], Program]]
    executable: Executable
    options: Any
    training: bool
    forward: Callable
    groupings: Dict[str, Any]
    version: str
    model: Optional[torch.nn.Module] = None
    optimizer: Optional[torch.optim.Optimizer] = None
    param_names: Dict[int, str] = dataclasses.field(default_factory=dict)
    session: Any = None
    rng_state: Optional[list] = None


def _weights_record(model: torch.nn.Module) -> Tuple[Dict[str, Any], bytes]:
    """Host weights (one copy per tensor) and their layout."""
    with instrument.syncing():
        kinds: Dict[str, str] = {}
        tensors: Dict[str, torch.Tensor] = {}
        aliases: Dict[str, str] = {}
        first: Dict[int, str] = {}
        for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                            ("buffer", model.named_buffers(remove_duplicate=False))):
            for name, tensor in named:
                if id(tensor) in first:
                    aliases[name] = first[id(tensor)]
                    continue
                first[id(tensor)] = name
                owner = model.get_submodule(name.rpartition(".")[0]) if "." in name \
                    else model
                persistent = name.rpartition(".")[2] not in getattr(
                    owner, "_non_persistent_buffers_set", set())
                kinds[name] = kind if kind == "parameter" or persistent \
                    else "buffer_non_persistent"
                tensors[name] = tensor.detach()
                if kind == "parameter":
                    kinds[name] += "" if tensor.requires_grad else "_frozen"
    return {"kinds": kinds, "aliases": aliases}, tensors_to_bytes(tensors)


def save(filename: str, saved: Saved) -> None:
    """See :meth:`poptorch.PoplarExecutor.save`."""
    if not saved.executable.graph.has_device_work():
        raise backend_error("Nothing to export: the model's graph does no work on the "
                            "device (it only passes inputs or constants through).")
    path = _target_path(filename)
    program = saved.program
    if program.blobs is None:  # serialize the uncompiled program (captured again)
        program.blobs = to_blobs(saved.recapture())
    blobs = dict(program.blobs)
    meta: Dict[str, Any] = {
        "kind": "executable", "poptorch_version": saved.version,
        "torch_version": torch.__version__, "training": saved.training,
        "export_model": saved.model is not None, "options": encode(saved.options),
        "replica_groupings": encode(dict(saved.groupings)),
        "signature": encode_signature(saved.forward),
    }
    if saved.model is not None:
        meta["weights"], blobs["weights.safetensors"] = _weights_record(saved.model)
        if saved.optimizer is not None:
            meta["optimizer"], blobs["optimizer.safetensors"] = optimizer_record(
                saved.optimizer, saved.param_names,
                device_state_of(saved.optimizer, saved.session))
        try:
            with instrument.syncing():
                blobs["model.pkl"] = pickle.dumps(saved.model)
        except Exception as exc:  # unpicklable models are still loadable from the program
            logger.warning("The Python model is not stored in %s (it cannot be pickled: "
                           "%s); poptorch.load rebuilds it from the program.", path, exc)
    if saved.rng_state is not None:
        meta["rng_state"] = saved.rng_state
    blobs["metadata.json"] = json.dumps(meta).encode()
    write_container(path, blobs)
    logger.info("Saved the executable to %s", path)


# -- loading --------------------------------------------------------------------------

def import_metadata(filename: str) -> bytes:
    """See :func:`poptorch.importPoptorchMetadataFromFile`."""
    return read_file(filename)[0]["metadata.json"]


def _options_difference(current, stored) -> Optional[str]:
    """The first compile-time option whose value differs, or ``None`` (a pipeline
    across processes runs as the loading process: see :mod:`.processes`)."""
    then = stored.toDict()
    skip = _RUNTIME_OPTIONS | (PROCESS_KEYS if then.get("pipeline_across_processes")
                               else frozenset())
    now = {k: v for k, v in current.toDict().items() if k not in skip}
    then = {k: v for k, v in then.items() if k not in skip}
    for key in sorted(set(now) | set(then), key=str):
        if str(now.get(key)) != str(then.get(key)):
            return f"{key} is {now.get(key)!r} here but {then.get(key)!r} in the file"
    return None


@dataclasses.dataclass
class Expected:
    """The wrapper a stored executable is loaded into (docs/semantics.md S-62: the file must hold an
    executable for this kind of model, weights and ``forward``, with the same
    compile-time options).

    Attributes:
        training: a training wrapper.
        tensors: the captured model's parameters and buffers by name.
        groupings: its replica groupings (their weights' shapes are not compared).
        signature: ``forward``'s signature (``None``: not inspectable).
        options: the wrapper's ``Options``.
        version: this PopTorch's version.
    """
    training: bool
    tensors: Dict[str, torch.Tensor]
    groupings: Dict[str, Any]
    signature: Optional[inspect.Signature]
    options: Any
    version: str


def _check_fits(expected: Expected, filename: str, checked: CheckedFile) -> None:
    """Raise unless the file's (checked) executable fits ``expected``.

    Raises:
        poptorch.Error: naming the first difference.
    """
    def fail(reason: str):
        raise backend_error(f"Invalid file {filename}: {reason}. Load it into a wrapper "
                            "of the model it was exported from, created with the same "
                            "options.")

    kind = {True: "training", False: "inference"}
    meta, structure = checked.meta, checked.structure
    if meta["training"] != expected.training:
        fail(f"it holds a {kind[meta['training']]} executable but this is an "
             f"{kind[expected.training]} model")
    host = expected.tensors
    for entry in structure["state"]:
        tensor = host.get(entry["name"])
        if tensor is None:
            fail(f"the executable was compiled for a model with a weight "
                 f"{entry['name']} that this model does not have")
        if entry["name"] not in expected.groupings and \
                list(tensor.shape) != entry["shape"]:
            fail(f"weight {entry['name']} has shape {list(tensor.shape)} here but "
                 f"{entry['shape']} in the executable")
    names = {e["name"] for e in structure["state"]}
    extra = sorted(n for n, t in host.items() if n not in names and isinstance(
        t, torch.nn.Parameter))
    if extra:
        fail(f"this model has parameters {extra[:5]} that the executable does not use")
    here = expected.signature
    if here is not None and meta.get("signature") is not None and \
            list(here.parameters) != list(checked.signature.parameters):
        fail(f"forward takes {list(here.parameters)} here but "
             f"{list(checked.signature.parameters)} in the executable")
    difference = _options_difference(expected.options, checked.options)
    if difference is not None:
        fail(f"compile-time option {difference}")


def _check_version(filename: str, meta: Dict[str, Any], version: str,
                   error: Callable) -> None:
    if meta.get("poptorch_version") != version:
        raise error(f"Invalid file {filename}: PopTorch version mismatch (the file was "
                    f"written by {meta.get('poptorch_version')}, this is {version}).")


def load_executable(filename: str, expected: Expected) -> Program:
    """See :meth:`poptorch.PoplarExecutor.loadExecutable`: the stored program, once
    every part of the file is checked and found to fit ``expected``.

    Raises:
        poptorch.Error: "Invalid file <f>: <reason>".
    """
    filename = os.fspath(filename)
    blobs, meta = read_file(filename)
    _check_version(filename, meta, expected.version, backend_error)
    checked = check_file(filename, blobs, meta, with_model=False)
    _check_fits(expected, filename, checked)
    return from_blobs(blobs, filename)


@contextlib.contextmanager
def from_file(filename: str, what: str) -> Iterator[None]:
    """A step that applies the checked contents of ``filename`` (``what``: the part):
    what it raises is the file's fault, reported as "Invalid file <f>: <what>: ..."."""
    try:
        yield
    except Invalid as exc:
        raise invalid_file(filename, exc) from None
    except Error as exc:
        raise invalid_file(filename, f"{what}: {exc.message}") from None
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as exc:
        raise invalid_file(filename, f"{what}: {type(exc).__name__}: {exc}") from None


class ExportedModel(torch.nn.Module):
    """The model of an exported file, rebuilt without its Python source: the stored
    parameters and buffers under their original names, and ``forward``'s signature
    (used to bind call arguments). It is not itself callable on the host: the loaded
    executor runs the stored program.
    """

    def __init__(self, layout: Dict[str, Any], weights: Dict[str, torch.Tensor],
                 signature):
        super().__init__()
        for name, kind in layout["kinds"].items():
            path, _, attr = name.rpartition(".")
            owner = self
            for part in path.split(".") if path else []:
                if part not in owner._modules:
                    owner.add_module(part, torch.nn.Module())
                owner = owner._modules[part]
            value = weights[name]
            if kind.startswith("parameter"):
                owner.register_parameter(attr, torch.nn.Parameter(
                    value, requires_grad=not kind.endswith("_frozen")))
            else:
                owner.register_buffer(attr, value,
                                      persistent=kind != "buffer_non_persistent")
        for alias, target in layout["aliases"].items():
            path, _, attr = alias.rpartition(".")
            owner = self.get_submodule(path) if path else self
            tensor = self.get_parameter(target) if target in dict(
                self.named_parameters()) else self.get_buffer(target)
            if isinstance(tensor, torch.nn.Parameter):
                owner.register_parameter(attr, tensor)
            else:
                owner.register_buffer(attr, tensor)

        def forward(*args, **kwargs):
            raise py_error("This model was loaded from an exported file without its "
                           "Python source: it cannot be captured again (e.g. after "
                           "destroy()). Load the file again with poptorch.load(), or "
                           "rebuild the original model, wrap it and call "
                           "loadExecutable() or compile().")
        forward.__signature__ = decode_signature(signature)  # type: ignore[attr-defined]
        self.forward = forward


def _loaded_model(filename: str, blobs, checked: CheckedFile,
                  unpickle_model: bool) -> torch.nn.Module:
    if unpickle_model:
        if "model.pkl" not in blobs:
            raise backend_error(f"Invalid file {filename}: it holds no pickled Python "
                                "model (it could not be pickled when saved).")
        model = pickle.loads(blobs["model.pkl"])  # noqa: S301 - the caller opted in
        if instrument.is_instrumented(model):
            model.__class__ = instrument.original_class(model)
        return model
    with from_file(filename, "metadata.json.weights"):
        return ExportedModel(checked.meta["weights"], checked.weights,
                             checked.meta["signature"])


@dataclasses.dataclass
class Loaded:
    """An exported file, read and checked: what ``poptorch.load`` wraps
    (:func:`poptorch._executor.wrapping.wrap_loaded`).

    Attributes:
        filename: the file.
        options: the stored ``Options`` (unfrozen, edited by ``edit_opts_fn``).
        model: the rebuilt model (:class:`ExportedModel`, or the unpickled one).
        training: a training executable.
        optimizer: the rebuilt optimizer (training), or ``None``.
        optimizer_state: the stored device state of a ``torch.optim`` optimizer.
        program: the stored program.
        groupings: replica groupings of weights (docs/semantics.md S-27).
        rng_state: the stored RNG state, or ``None``.
        version: the PopTorch version that wrote it (this one).
        checked: the checked parts of the file.
        offline: it was compiled without a device (``connectionType Never``), so it
            stores no optimizer device state.
    """
    filename: str
    options: Any
    model: torch.nn.Module
    training: bool
    optimizer: Optional[torch.optim.Optimizer]
    optimizer_state: bytes
    program: Program
    groupings: Dict[str, Any]
    rng_state: Optional[list]
    version: str
    checked: CheckedFile = dataclasses.field(repr=False, default=None)
    offline: bool = False

    def check(self, expected: Expected) -> None:
        """Raise unless the stored program fits the wrapper built for it.

        Raises:
            poptorch.Error: "Invalid file <f>: <reason>".
        """
        _check_fits(expected, self.filename, self.checked)

    def part(self, what: str):
        """Context manager: errors while applying ``what`` of the file to the wrapper
        are the file's (see :func:`from_file`)."""
        return from_file(self.filename, what)


def read_exported(filename: str, version: str, edit_opts_fn: Optional[Callable] = None,
                  unpickle_model: bool = False) -> Loaded:
    """See :func:`poptorch.load`: read and check everything an exported file holds
    before building anything from it.

    Raises:
        poptorch.Error: an unreadable or malformed file ("Invalid file <f>: ...").
        AssertionError: another PopTorch version; no model in the file.
    """
    filename = os.fspath(filename)
    blobs, meta = read_file(filename)
    _check_version(filename, meta, version, AssertionError)
    if not meta.get("export_model"):
        raise AssertionError(
            f"Invalid file {filename}: it was saved with export_model=False and holds no "
            "model. Re-create the model and its wrapper (poptorch.trainingModel / "
            "poptorch.inferenceModel) and call wrapper.loadExecutable("
            f"{filename!r}) instead.")
    checked = check_file(filename, blobs, meta, with_model=True)
    options = decode(meta["options"])  # a copy: checked.options is what the file holds
    options._unfreeze()
    options.deleteIfExists("ipu_version")
    _use_local_paths(options)
    offline = options.connection_type == enums.ConnectionType.Never.value
    if offline:
        options.connectionType(enums.ConnectionType.Always)
    adopt_processes(filename, options, bool(meta["training"]))
    if edit_opts_fn is not None:
        edit_opts_fn(options)
    model = _loaded_model(filename, blobs, checked, unpickle_model)
    optimizer = None
    if meta["training"] and "optimizer" in meta:
        with instrument.syncing():
            params = dict(model.named_parameters())
        with from_file(filename, "metadata.json.optimizer"):
            optimizer = rebuild_optimizer(meta["optimizer"], blobs["optimizer.safetensors"],
                                          params)
    return Loaded(filename, options, model, bool(meta["training"]), optimizer,
                  blobs.get("optimizer.safetensors", b""), checked.program,
                  dict(checked.groupings), meta.get("rng_state"), version, checked,
                  offline=offline)
