"""Child process of ``test_cache_key_state.py`` (issue 29, item 1): like
``cache_key_worker.py``, for state outside the model's attributes: the environment, a file,
torch's process-wide settings, tied weights and shared sub-modules, library functions
replaced by the user, conjugate tensors. ``argv``: cache directory, variant (``a`` /
``b``), result file (JSON: per case the output, the plain PyTorch output, the number of
captures and the cache's log lines)."""
import enum
import inspect
import os
import sys

import torch
import torch.nn.functional as F

from cache_worker_common import run_cases

CACHE, VARIANT, RESULT = sys.argv[1], sys.argv[2], sys.argv[3]
A = VARIANT == "a"
SCALE = 2.0 if A else 3.0


class Base(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)


class Environ(Base):
    def forward(self, x):
        return self.fc(x) * float(os.environ.get("CACHE_KEY_TEST_SCALE", "1"))


class Getenv(Base):
    def forward(self, x):
        return self.fc(x) * float(os.getenv("CACHE_KEY_TEST_SCALE", "1"))


ENV = os.environ


def scaled_by_environment(t):
    return t * float(ENV["CACHE_KEY_TEST_SCALE"])


class Helper(Base):
    """Reads the environment in a helper, through a global holding ``os.environ``."""

    def forward(self, x):
        return scaled_by_environment(self.fc(x))


class ReadsFile(Base):
    def forward(self, x):
        with open(os.path.join(CACHE, "scale.txt"), encoding="utf-8") as f:
            return self.fc(x) * float(f.read())


class DefaultDtype(Base):
    def forward(self, x):
        return self.fc(x) * (3.0 if torch.get_default_dtype() == torch.float64 else 2.0)


class Deterministic(Base):
    def forward(self, x):
        return self.fc(x) * (3.0 if torch.are_deterministic_algorithms_enabled() else 2.0)


class GradMode(Base):
    def forward(self, x):
        return self.fc(x) * (3.0 if torch.is_grad_enabled() else 2.0)


class Two(torch.nn.Module):
    def __init__(self, tie):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        if tie == "weights":
            self.b.weight = self.a.weight
        elif tie == "module":
            self.b = self.a

    def forward(self, x):
        return self.b(self.a(x))


class Chained(Base):
    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x))


class Direct(Base):
    def forward(self, x):
        return F.silu(self.fc(x))


class OnLibraryClass(torch.nn.Linear):
    def forward(self, x):
        return self.act(super().forward(x))


class Conjugate(Base):
    def __init__(self):
        super().__init__()
        self.c = torch.full((4,), SCALE, dtype=torch.cfloat).conj()  # failed the key

    def forward(self, x):
        return self.fc(x) * SCALE


def _setting(case):
    """Sets variant b's process-wide state for ``case``; returns how to undo it."""
    if case == "default_dtype" and not A:
        torch.set_default_dtype(torch.float64)
        return lambda: torch.set_default_dtype(torch.float32)
    if case == "deterministic" and not A:
        torch.use_deterministic_algorithms(True)
        return lambda: torch.use_deterministic_algorithms(False)
    if case == "grad_mode":
        before = torch.is_grad_enabled()
        torch.set_grad_enabled(not A)
        return lambda: torch.set_grad_enabled(before)
    return lambda: None


class Scale(enum.Enum):
    """A user enum whose member's value differs between the variants."""
    FACTOR = SCALE


class EnumMember(Base):
    def forward(self, x):
        return self.fc(x) * Scale.FACTOR.value


class ByGlobals(Base):
    def forward(self, x):
        return self.fc(x) * globals()["SCALE"]


class ByEval(Base):
    def forward(self, x):
        return self.fc(x) * eval("SCALE")  # pylint: disable=eval-used


def scale_of_the_caller():
    return inspect.currentframe().f_back.f_globals["SCALE"]


class ByFrame(Base):
    def forward(self, x):
        return self.fc(x) * scale_of_the_caller()


CASES = {"environ": Environ, "getenv": Getenv, "helper": Helper, "reads_file": ReadsFile,
         "default_dtype": DefaultDtype, "deterministic": Deterministic, "grad_mode": GradMode,
         "tied_weights": lambda: Two("weights" if A else ""),
         "shared_module": lambda: Two("module" if A else ""), "patched_chained": Chained,
         "patched_direct": Direct, "on_library_class": lambda: OnLibraryClass(4, 4),
         "conjugate": Conjugate, "enum_member": EnumMember, "by_globals": ByGlobals,
         "by_eval": ByEval, "by_frame": ByFrame}


def main():
    os.environ["CACHE_KEY_TEST_SCALE"] = str(SCALE)
    os.makedirs(CACHE, exist_ok=True)
    with open(os.path.join(CACHE, "scale.txt"), "w", encoding="utf-8") as f:
        f.write(str(SCALE))
    if not A:
        torch.nn.functional.gelu = torch.tanh
        F.silu = torch.tanh
    torch.nn.Linear.act = staticmethod(torch.relu if A else torch.tanh)
    run_cases(CASES, CACHE, RESULT, torch.linspace(-1, 1, 8, dtype=torch.float32)
              .reshape(2, 4), _setting)


if __name__ == "__main__":
    main()
