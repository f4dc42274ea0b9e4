"""Hyper-parameter tensors by PopART name: derived from a description, turned back into
description values when written (popart_compiler.optim.loaded_params)."""
import torch

from popart_compiler.optim.description import OptimizerDescription
from popart_compiler.optim.loaded_params import derived_hyper_parameters, with_written


def _sgd(**hyper):
    return OptimizerDescription("SGD", defaults=dict(lr=0.1, **hyper), groups=[],
                                group_of={}, loss_scaling=2.0)


def test_sgd_names_and_values():
    params = derived_hyper_parameters(_sgd(dampening=0.5, weight_decay=0.1), ["w"])
    assert params["scaledLearningRate0___specific___w"].item() == \
        torch.tensor(0.1 * 0.5 / 2.0).item()
    assert params["weightDecayScaleFactor0___specific___w"].item() == \
        torch.tensor(1 - 0.1 * 0.5 * 0.1).item()
    assert params["lossScaling_FLOAT"].item() == 2.0


def test_written_specific_sgd_value_gets_a_group_of_its_own():
    d = _sgd(dampening=0.5, weight_decay=0.1)
    new = with_written(d, ["w", "b"], {"scaledLearningRate0___specific___w": 0.2})
    assert new.defaults == d.defaults and new.hyper("b") == d.defaults
    assert new.hyper("w")["lr"] == 0.2 * 2.0 / 0.5  # lr = slr × lossScaling / (1 − d)
    assert new.hyper("w")["weight_decay"] == 0.1
    assert d.groups == [] and d.group_of == {}  # the original is unchanged


def test_written_adam_betas_and_loss_scaling():
    d = OptimizerDescription("Adam", defaults={"lr": 0.1, "betas": (0.9, 0.999)},
                             groups=[], group_of={})
    new = with_written(d, ["w"], {"beta2___default___FLOAT": 0.5, "lossScaling_FLOAT": 4.0})
    assert new.defaults["betas"] == (0.9, 0.5) and new.loss_scaling == 4.0
    assert with_written(d, ["w"], {}) is d
