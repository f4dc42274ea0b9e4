"""The ``auto`` backend: the eager backend at once, Inductor once a program is hot, and
whichever of the two runs it faster.

Policy, per compiled program (one session):

1. Every call runs on the eager backend until the program has proven hot: at least
   :attr:`AutoPolicy.hot_calls` calls (3) *and* at least :attr:`AutoPolicy.hot_seconds`
   (1 s) spent in all of them, by the policy's clock, *and* that time is at least the
   expected compilation time over :attr:`AutoPolicy.compile_budget` (0.05: 20 times
   it). As a tiered JIT: a compilation is only paid for by a program that has already
   run long enough that the compilation costs it at most 5 %, so a short program never
   pays more than that over eager (and most never compile). The expected time is the
   one recorded for this program on this machine, else an estimate from the graph's
   size scaled by what earlier compilations on this machine took
   (:func:`~popart_compiler.backends.decisions.compile_estimate`). The first result is
   never later than the eager backend's.
2. Then TorchInductor compiles the program in a background thread at the lowest OS
   priority (holding
   :data:`~popart_compiler.backends.tracing.TRACE_LOCK`, as every compilation does;
   running does not) while calls keep running on the eager backend. A compilation
   still running when the main thread ends stops at Inductor's next step that needs
   the interpreter alive (its thread is no daemon, so the exit never aborts).
3. Once compiled, the next calls alternate between the two backends on the real inputs:
   one untimed Inductor call (its first call pays one-off costs), then
   :attr:`AutoPolicy.trials` timed calls of each. Inductor is kept if its fastest call
   is faster than the fastest eager call by more than :attr:`AutoPolicy.margin`;
   otherwise the eager backend is kept and Inductor's compilation is dropped. (The
   fastest call, not the median: on a shared machine the time other processes take
   only ever adds to a call.)
   Logged at INFO: the start of the compilation (calls and seconds so far), its end
   (its duration) and the choice (the fastest timed calls); at DEBUG each call while
   the program is not hot yet.
4. Any Inductor failure (compiling, or a call raising) logs one warning and keeps the
   eager backend for good; a call that failed on Inductor is run again on the eager
   backend (the session has rolled the device state back first).

5. The decision is recorded per machine (:mod:`.decisions`, issue 30): a later session
   of the same program (another run of the script) is given it as ``start`` and runs
   that backend from its first call, without timing; ``POPTORCH_AUTO_BACKEND`` pins it
   or makes the session decide again.

Backends switch only between calls (a call is one ``session.run``: every device
iteration, its optimizer steps and weight updates), and both read and write the same
device weights and optimizer state, so training continues seamlessly. Results of the two
backends agree to float rounding (see ``docs/backends.md``, "Numerics").

Programs that the policy leaves on the eager backend for good: checked floating-point
exceptions (the op-by-op checker), pipelined programs (several stages), and programs
with host side effects (per-micro-batch ops: ``ipu_print_tensor``, ``poptorch.CPU``,
custom ops).

:data:`POLICY` holds the process-wide settings; :func:`policy` changes them for a
``with`` block (tests make the compilation synchronous and inject the timings).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from typing import Callable, Iterator, List, Optional

import torch

from popart_compiler.logging import logger

try:
    import resource  # POSIX only: the CPU time of the compiler's child processes
except ImportError:  # pragma: no cover - Windows
    resource = None

__all__ = ["AutoPolicy", "POLICY", "policy", "Lowering", "AutoChooser"]


@dataclasses.dataclass
class AutoPolicy:
    """Settings of the ``auto`` backend.

    Attributes:
        hot_calls: calls on the eager backend after which the program counts as hot and
            Inductor compiles it (default 3)...
        hot_seconds: ...once these calls took this many seconds in all (by ``clock``;
            default 1.0), and at least the expected compilation time over
            ``compile_budget``.
        compile_budget: the most a compilation may cost, as a fraction of the time
            the program's calls have already taken (default 0.05: a program compiles
            only once its calls took 20 times the expected compilation time, so a
            program that stops right then paid at most 5 % over the eager backend).
        compile_seconds: the expected compilation time in seconds (default ``None``:
            the session's estimate, :func:`~popart_compiler.backends.decisions.
            compile_estimate`; tests and benchmarks inject 0).
        trials: timed calls of each backend before choosing (default 5).
        margin: Inductor is kept only if its fastest timed call is below
            ``(1 - margin) ×`` the fastest eager call (default 0.05: where the two are
            closer, timing noise on a shared machine decides more than the backends;
            with 3 trials and a margin of 0.02, BERT inference kept Inductor at 1.06×
            the eager backend's time).
        synchronous: compile in the calling thread, between two calls, instead of a
            background thread (tests; default ``False``).
        clock: what a call is timed with (seconds); default (``None``): the calling
            thread's CPU time (``time.thread_time``) where the program runs on the CPU
            with one PyTorch thread (every kernel then runs in the calling thread, and
            time other processes hold the core is left out), else the wall clock
            (``time.perf_counter``).
        measure: ``measure(backend, seconds) -> float``: the figure compared for one
            timed call of ``backend`` (``"eager"`` / ``"inductor"``) that took
            ``seconds`` by ``clock``; default: the seconds. Tests inject figures here so
            that the choice never depends on the machine.
    """
    hot_calls: int = 3
    hot_seconds: float = 1.0
    compile_budget: float = 0.05
    compile_seconds: Optional[float] = None
    trials: int = 5
    margin: float = 0.05
    synchronous: bool = False
    clock: Optional[Callable[[], float]] = None
    measure: Optional[Callable[[str, float], float]] = None


#: The process-wide policy (read when a session is created).
POLICY = AutoPolicy()


@contextlib.contextmanager
def policy(**changes) -> Iterator[AutoPolicy]:
    """Change fields of :data:`POLICY` for the ``with`` block (sessions created inside
    keep the changed policy).

    Raises:
        TypeError: an unknown field.
    """
    global POLICY  # pylint: disable=global-statement
    before = POLICY
    POLICY = dataclasses.replace(before, **changes)
    try:
        yield POLICY
    finally:
        POLICY = before


@dataclasses.dataclass
class Lowering:
    """What runs a program on one backend (a session runs one at a time).

    Attributes:
        name: ``"eager"`` or ``"inductor"``.
        runner: runs one micro-batch: ``runner(*state, *inputs)``.
        vectorized: stateless inference: runs ``vectorized_slots`` micro-batches at once
            (``None``: loop over ``runner``).
        vectorized_slots: micro-batches per call of ``vectorized``.
    """
    name: str
    runner: Callable
    vectorized: Optional[Callable] = None
    vectorized_slots: int = 1


class AutoChooser:
    """Chooses the backend of each call of one session (see the module docstring).

    Args:
        eager: the eager lowering (what runs until Inductor is chosen).
        compile_inductor: builds and compiles the Inductor lowering (called once, in a
            background thread unless the policy is synchronous); raises on failure.
        device: the execution device (``"cpu"`` / ``"cuda"``), for the default clock.
        settings: the policy (default: :data:`POLICY` at construction).
        start: the backend to run from the first call, without timing (a decision
            recorded by an earlier run or pinned: :mod:`.decisions`); ``"inductor"``
            compiles before the first call, in the calling thread. ``None`` (default):
            decide by the policy.
        on_decide: ``on_decide(backend, why)``, called once when this session decides
            (by timing, or an Inductor failure): records the decision.
        source: where ``start`` came from, for the log.
        expected_compile: the expected compilation time (seconds; default ``None``:
            unknown, only ``hot_seconds`` counts); ``policy.compile_seconds`` overrides.
        on_compiled: ``on_compiled(seconds)``, called after a compilation succeeded
            with its CPU time (the compiling thread's and that of the processes it ran
            and waited for, :func:`_compile_cpu_seconds`): records it for the next
            estimate.
    """

    def __init__(self, eager: Lowering, compile_inductor: Callable[[], Lowering],
                 device: str = "cpu", settings: Optional[AutoPolicy] = None,
                 start: Optional[str] = None,
                 on_decide: Optional[Callable[[str, str], None]] = None, source: str = "",
                 expected_compile: Optional[float] = None,
                 on_compiled: Optional[Callable[[float], None]] = None):
        self.policy = settings if settings is not None else POLICY
        expected = self.policy.compile_seconds
        expected = (expected_compile or 0.0) if expected is None else expected
        budget = self.policy.compile_budget
        #: seconds the calls must have taken before compiling
        self.hot_seconds = max(self.policy.hot_seconds,
                               expected / budget if budget > 0 else float("inf"))
        self._on_compiled = on_compiled
        self._clock = self.policy.clock or (
            time.thread_time if device == "cpu" and torch.get_num_threads() == 1
            else time.perf_counter)
        self.eager = eager
        self._compile = compile_inductor
        self._inductor: Optional[Lowering] = None
        self._thread: Optional[threading.Thread] = None
        self._calls = 0
        self._spent = 0.0  # seconds of the calls before compiling
        self._warmed = False
        self._times = {"eager": [], "inductor": []}  # type: dict
        #: the backend kept for good (``None`` while undecided)
        self.chosen: Optional[str] = None
        self._on_decide = on_decide
        self._start = start
        self._source = source
        if start == "eager":
            self.chosen = "eager"
            logger.info("Backend auto: running eager (%s)", source)

    @property
    def compiling(self) -> bool:
        """Inductor is compiling in the background."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> None:
        """Wait for a background compilation to finish (benchmarks)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def run(self, call: Callable[[Lowering], List]) -> List:
        """Run one call: ``call(lowering)`` on the backend chosen for it, timing it while
        the choice is open. An Inductor failure is logged once, and the call is run
        again on the eager backend."""
        if self.chosen is not None:  # decided: nothing more to time or count
            lowering = self._inductor if self.chosen == "inductor" else self.eager
            return self._call(call, lowering)
        lowering = self._pick()
        # timed for the choice only if Inductor was ready when the call started (a
        # call beside the compilation would count the compilation's load)
        trial = self.chosen is None and self._inductor is not None and not self.compiling
        start = self._clock()
        outs = self._call(call, lowering)
        self._record(lowering.name, self._clock() - start, trial)
        return outs

    def _call(self, call: Callable[[Lowering], List], lowering: Lowering) -> List:
        """``call(lowering)``; if Inductor's raises, the failure is logged once and the
        call runs again on the eager backend, for good."""
        if lowering.name == "eager":
            return call(lowering)
        try:
            return call(lowering)
        except Exception as e:  # pylint: disable=broad-except
            self._fail(f"a call on the compiled program raised {type(e).__name__}: {e}")
            return call(self.eager)

    # -- the policy ---------------------------------------------------------------------

    def _pick(self) -> Lowering:
        if self.chosen is not None:
            return self._inductor if self.chosen == "inductor" else self.eager
        if self._start == "inductor":
            return self._start_on_inductor()
        if self._thread is None and self._inductor is None:
            if self._calls >= max(1, self.policy.hot_calls) and \
                    self._spent >= self.hot_seconds:  # the first call: eager
                self._start_compiling()
            if self.chosen is not None:  # a synchronous compilation failed
                return self.eager
        if self._inductor is None or self.compiling:
            return self.eager
        if not self._warmed:
            return self._inductor
        # alternate, eager first: the one with fewer timed calls runs
        times = self._times
        return self._inductor if len(times["inductor"]) < len(times["eager"]) else self.eager

    def _record(self, name: str, seconds: float, trial: bool) -> None:
        self._calls += 1
        if self._inductor is None and self._thread is None and self.chosen is None:
            self._spent += seconds
            logger.debug("Backend auto: not hot yet after %d calls taking %.4g s in all "
                         "(compiles after %d calls and %.4g s in all)", self._calls,
                         self._spent, self.policy.hot_calls, self.hot_seconds)
        if not trial or self.chosen is not None:
            return
        if name == "inductor" and not self._warmed:
            self._warmed = True  # the first call is not timed (one-off costs)
            return
        measure = self.policy.measure
        self._times[name].append(measure(name, seconds) if measure else seconds)
        trials = self.policy.trials
        if all(len(t) >= trials for t in self._times.values()):
            eager = min(self._times["eager"])
            compiled = min(self._times["inductor"])
            faster = compiled < (1.0 - self.policy.margin) * eager
            self._decide("inductor" if faster else "eager",
                         f"fastest call {compiled:.4g} s on inductor against "
                         f"{eager:.4g} s on eager")

    def _start_on_inductor(self) -> Lowering:
        """The first call of a session whose backend is known to be Inductor: compile
        now, in the calling thread, and run every call on it (eager if it fails)."""
        logger.info("Backend auto: compiling with TorchInductor before the first call "
                    "(%s)", self._source)
        self._start = None
        self._build(timing=False)
        if self._inductor is None:  # failed: _fail kept eager
            return self.eager
        self.chosen = "inductor"
        return self._inductor

    def _decide(self, name: str, why: str) -> None:
        self.chosen = name
        if name == "eager":
            self._inductor = None  # free the compiled kernels
        logger.info("Backend auto: keeping %s (%s)", name, why)
        if self._on_decide is not None:
            self._on_decide(name, why)

    def _fail(self, why: str) -> None:
        logger.warning("Backend auto: TorchInductor failed (%s); this program keeps "
                       "running on the eager backend.", why)
        self._decide("eager", "Inductor failed")

    def _start_compiling(self) -> None:
        logger.info("Backend auto: the program is hot (%d calls took %.4g s in all; "
                    "thresholds %d calls and %.4g s): compiling it with TorchInductor %s",
                    self._calls, self._spent, self.policy.hot_calls, self.hot_seconds,
                    "before the next call" if self.policy.synchronous
                    else "while calls keep running on the eager backend")
        if self.policy.synchronous:
            self._build()
            return
        # not a daemon: the interpreter's exit waits for the compilation (a daemon
        # thread inside Inductor's compiler at exit aborted the process: "terminate
        # called without an active exception")
        self._thread = threading.Thread(target=self._build_in_background, daemon=False,
                                        name="poptorch-auto-inductor")
        self._thread.start()

    def _build_in_background(self) -> None:
        """The compilation thread: at the lowest OS priority (Linux: a thread's nice
        value; Inductor's compile workers, started from it, inherit it), so that it
        takes only the cores the training leaves idle."""
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError) as e:  # not Linux, or not permitted
            logger.debug("Backend auto: compiling at normal priority (%s)", e)
        self._build()

    def _build(self, timing: bool = True) -> None:
        """Compile; ``timing``: both backends are timed on the next calls (else the
        recorded choice, Inductor, runs from now on)."""
        start, cpu = time.perf_counter(), _compile_cpu_seconds()
        try:
            lowering = self._compile()
        except Exception as e:  # pylint: disable=broad-except
            if not threading.main_thread().is_alive():
                # the interpreter is exiting (Inductor can no longer start its workers)
                logger.debug("Backend auto: compilation stopped at exit (%s)", e)
                return
            self._fail(f"compiling raised {type(e).__name__}: {e}")
            return
        wall, cpu = time.perf_counter() - start, _compile_cpu_seconds() - cpu
        then = (f"timing {self.policy.trials} calls of each backend before choosing"
                if timing else "running it from now on (the recorded choice)")
        graph = lowering.vectorized if lowering.vectorized is not None else lowering.runner
        if getattr(graph, "runs_as_is", False):
            logger.info("Backend auto: the program is prepacked kernels only: it runs as it "
                        "is, without a TorchInductor compilation (%.3g s, %.3g s of CPU); %s",
                        wall, cpu, then)
        else:
            logger.info("Backend auto: TorchInductor compiled the program in %.3g s (%.3g s "
                        "of CPU); %s", wall, cpu, then)
        if self._on_compiled is not None:
            # CPU time: a compilation that waited behind the program's own calls at low
            # priority took long on the clock, not in work, and must not raise the next
            # estimate
            self._on_compiled(cpu)
        self._inductor = lowering


def _compile_cpu_seconds() -> float:
    """CPU seconds so far of the calling thread plus the child processes this process
    has waited for (Inductor's C++ compiler runs; ``resource`` is POSIX: elsewhere the
    thread's alone)."""
    if resource is None:
        return time.thread_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.thread_time() + children.ru_utime + children.ru_stime
