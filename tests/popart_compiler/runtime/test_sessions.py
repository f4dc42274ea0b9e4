"""``open_session`` and ``session_class`` (runtime/sessions.py): the session class of an
executable (training or inference; one stage per process for a pipeline across
processes) and a session built from the executable's plain data, with runners given or
lowered by the session itself. Nothing here imports ``poptorch``."""
import dataclasses

import torch

from models import MLP, Classifier, export
from popart_compiler import compiler
from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.runtime.lowering import lower
from popart_compiler.runtime.pipeline import (PipelineInferenceSession,
                                              PipelineTrainingSession)
from popart_compiler.runtime.session import InferenceSession
from popart_compiler.runtime.sessions import open_session, session_class
from popart_compiler.runtime.training import TrainingSession
from popart_compiler.session_options import SessionOptions


def sgd(lr=0.1):
    return OptimizerDescription("SGD", defaults=dict(lr=lr), groups=[], group_of={})


def inference(**options):
    return compiler.compile(export(MLP(), torch.randn(2, 4)), SessionOptions(**options),
                            False)


def training(**options):
    return compiler.compile(export(Classifier(), torch.randn(2, 6), torch.tensor([1, 3])),
                            SessionOptions(**options), True)


def test_the_session_class_follows_the_executable():
    assert session_class(inference()) is InferenceSession
    assert session_class(training()) is TrainingSession
    across = dataclasses.replace(inference().options, pipeline_across_processes=True)
    assert session_class(dataclasses.replace(inference(), options=across)) is \
        PipelineInferenceSession
    across = dataclasses.replace(training().options, pipeline_across_processes=True)
    assert session_class(dataclasses.replace(training(), options=across)) is \
        PipelineTrainingSession


def test_open_session_runs_the_runners_it_is_given():
    exe = inference(device_iterations=2)
    runners = lower(exe)
    session = open_session(exe, None, runners=runners)
    assert isinstance(session, InferenceSession) and session.runners is runners
    x = torch.randn(4, 4)
    state = [exe.graph.state_values()[n] for n in exe.graph.parameters]
    expected = torch.cat([exe.module(*state, x[:2])[0], exe.module(*state, x[2:])[0]])
    torch.testing.assert_close(session.run([x])[0], expected)


def test_open_session_lowers_a_training_executable_itself():
    exe = training()
    session = open_session(exe, None, sgd())
    assert isinstance(session, TrainingSession)
    assert session.runners.lowering.runner is exe.module
    out, loss = session.run([torch.randn(2, 6), torch.tensor([1, 3])])
    assert out.shape == (2, 4) and loss.shape == ()
