"""Child process of ``test_cache_key.py`` (issue 29, item 1): builds one model per case,
with the non-tensor state of variant ``argv[2]`` (``a`` or ``b``), runs each once
through ``poptorch.inferenceModel`` with the executable cache in ``argv[1]/<case>``,
and writes, per case, the output, the plain PyTorch output, the number of captures
and the cache's log lines to ``argv[3]`` (JSON)."""
import functools
import sys
import types

import torch

from cache_worker_common import run_cases

CACHE, VARIANT, RESULT = sys.argv[1], sys.argv[2], sys.argv[3]
A = VARIANT == "a"

#: Module-level state that ``forward`` reads.
CONFIG = types.SimpleNamespace(scale=2.0 if A else 3.0)
SCALE = 2.0 if A else 3.0


def scaled(x, factor):
    return x * factor


class Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)


class Dict(Base):
    def __init__(self):
        super().__init__()
        self.cfg = {"scale": 2.0 if A else 3.0}

    def forward(self, x):
        return self.fc(x) * self.cfg["scale"]


class Act(Base):
    """``self.act`` as the case says: a torch function, a lambda, a partial."""

    def __init__(self, case):
        super().__init__()
        if case == "function":
            self.act = torch.relu if A else torch.tanh
        elif case == "lambda":
            self.act = (lambda t: t * 2) if A else (lambda t: t * 3)
        else:
            self.act = functools.partial(scaled, factor=2.0 if A else 3.0)

    def forward(self, x):
        return self.act(self.fc(x))


class TensorInList(Base):
    def __init__(self):
        super().__init__()
        self.weights = [torch.full((4,), 2.0 if A else 3.0)]

    def forward(self, x):
        return self.fc(x) * self.weights[0]


class Namespace(Base):
    def __init__(self):
        super().__init__()
        self.cfg = types.SimpleNamespace(scale=2.0 if A else 3.0)

    def forward(self, x):
        return self.fc(x) * self.cfg.scale


class ModuleInDict(Base):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1 if A else 2)
        self.parts = {"lin": torch.nn.Linear(4, 4)}

    def forward(self, x):
        return self.parts["lin"](self.fc(x))


class GlobalNamespace(Base):
    def forward(self, x):
        return self.fc(x) * CONFIG.scale


class GlobalFloat(Base):
    def forward(self, x):
        return self.fc(x) * SCALE


CASES = {"dict": Dict, "function": lambda: Act("function"), "lambda": lambda: Act("lambda"),
         "partial": lambda: Act("partial"), "tensor_in_list": TensorInList,
         "namespace": Namespace, "module_in_dict": ModuleInDict,
         "global_namespace": GlobalNamespace, "global_float": GlobalFloat}


def main():
    run_cases(CASES, CACHE, RESULT, torch.linspace(-1, 1, 8).reshape(2, 4))


if __name__ == "__main__":
    main()
