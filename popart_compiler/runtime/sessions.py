"""Loading an :class:`~popart_compiler.stages.Executable`: the session class that runs
it and the session, built from the executable's plain data (the session lowers it to
its backend, :mod:`popart_compiler.runtime.lowering`)."""
from __future__ import annotations

from typing import Optional, Type

from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.runtime.device import IpuModel
from popart_compiler.runtime.lowering import Runners
from popart_compiler.runtime.pipeline import (PipelineInferenceSession,
                                              PipelineTrainingSession)
from popart_compiler.runtime.session import InferenceSession, Session
from popart_compiler.runtime.training import TrainingSession
from popart_compiler.stages import Executable

__all__ = ["session_class", "open_session"]


def session_class(exe: Executable) -> Type[Session]:
    """The class of the session running ``exe``: training or inference, one stage per
    process when its options ask for a pipeline across processes
    (``SessionOptions.pipeline_across_processes``)."""
    if exe.options.pipeline_across_processes:
        return PipelineTrainingSession if exe.training else PipelineInferenceSession
    return TrainingSession if exe.training else InferenceSession


def open_session(exe: Executable, device: Optional[IpuModel],
                 optimizer: Optional[OptimizerDescription] = None,
                 runners: Optional[Runners] = None) -> Session:
    """The session of ``exe`` on ``device`` (:func:`session_class`).

    Args:
        exe: the compiled program.
        device: the attached IPU Model (``None``: the options' torch device).
        optimizer: training: the optimizer to run on the device.
        runners: ``exe`` already lowered (and warmed up); default: the session lowers
            it (:func:`~popart_compiler.runtime.lowering.lower`).

    Raises:
        Error: what the session class raises (an invalid optimizer description, a
            pipeline across processes that cannot run, see
            :func:`~popart_compiler.runtime.pipeline.join_pipeline`).
    """
    cls = session_class(exe)
    if exe.training:
        return cls(exe, device, optimizer, runners=runners)
    return cls(exe, device, runners=runners)
