"""Host time of one call: what a Python loop of PopTorch calls sees beyond the device.

A call of a compiled PopTorch program (``model(inputs)``) runs ``deviceIterations``
device iterations of ``gradientAccumulation`` micro-batches on every replica; its
time, as Graphcore's benchmarks measure it around the call, is:

* **the device's run** (:mod:`.cycle_model`), which includes each device
  iteration's synchronisation with the host (:data:`STEP_SYNC_SECONDS`) and the
  stream copies that move each micro-batch's inputs from the IPU-Gateway into the IPU
  (:data:`GATEWAY_STREAM_BYTES_PER_S` per IPU, serial with compute: PopART's default
  host IO is not overlapped unless IO tiles are set);
* **the host link**: the data of every replica of an IPU-Machine crosses its one
  100 GbE RoCE link (IPU-M2000 and Bow-2000 alike: an RNIC on the IPU-Gateway,
  :data:`HOST_LINK_BYTES_PER_S` per machine). PopART prefetches each step's streams
  (``enablePrefetchDatastreams``, on by default), so the link's transfer of a
  micro-batch overlaps the device's work on the previous one and only its excess over
  the device time of a micro-batch, plus the first micro-batch's transfer, is seen;
* **the host's copies of the inputs** (:data:`HOST_COPY_BYTES_PER_S`): PopART's
  stream callbacks copy each micro-batch of every replica of the process from the
  tensors the call was given into the streams' host buffers, on the process's one
  thread that services the engine; prefetching overlaps them with the device's run,
  so like the host link only their excess over the device time is seen. A process
  whose replicas consume inputs faster than that copy rate is host-bound (the
  vision transformers' float16 / float32 images, a tutorial CNN's 2 replicas), and
  each process of a distributed run (``poprun --num-instances``) copies its own
  replicas' inputs (``HostSettings.host_processes``);
* **the other replicas' step synchronisations**: that thread also services each
  replica's synchronisation at the start of every step in turn; the device's run
  holds one (:data:`STEP_SYNC_SECONDS`), each further replica of the process adds its
  own (with synthetic data too: the tutorial CNN's 2 replicas take twice one
  replica's time per call on hardware);
* **the call's own work** (:data:`CALL_SECONDS`): PopTorch's argument checks and
  buffer hand-over, PopART's ``run`` and Poplar's engine start and completion, a
  round trip to the device;
* **outputs** (:class:`~popart_compiler.enums.OutputMode`): ``All`` returns every
  micro-batch's outputs, ``EveryN`` one in ``N`` device iterations, ``Final`` and
  ``Sum`` one per replica; they cross the host link after the run;
* **data loading**: with a ``DataLoader`` whose rate is known (samples per second of
  the loader alone, as Graphcore's tutorial measures it), loading the next call's
  samples; it is not hidden behind the call: the loader's rebatching and hand-over
  run on the host thread that makes the call.

Synthetic data (``enableSyntheticData``) moves no inputs or outputs. The figures are
public: 100 GbE per IPU-Machine (IPU-M2000 / Bow-2000 datasheets: the host connects
to the IPU-Gateway's RNIC), PCIe Gen4 x8 between the IPU-Gateway and each IPU
(16 GB/s); :data:`CALL_SECONDS` is an estimate of the software's per-call work.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from popart_compiler.enums import OutputMode

__all__ = ["HostSettings", "HostTime", "host_time", "HOST_LINK_BYTES_PER_S",
           "GATEWAY_STREAM_BYTES_PER_S", "CALL_SECONDS", "IPUS_PER_MACHINE",
           "STEP_SYNC_SECONDS", "HOST_COPY_BYTES_PER_S"]

#: Host link of one IPU-Machine (IPU-M2000, Bow-2000): 100 Gb/s RoCE.
HOST_LINK_BYTES_PER_S = 100e9 / 8
#: IPU-Gateway → IPU stream copies, per IPU: PCIe Gen4 x8.
GATEWAY_STREAM_BYTES_PER_S = 16e9
#: IPUs per IPU-Machine (one host link each).
IPUS_PER_MACHINE = 4
#: PopTorch's, PopART's and Poplar's work per call, besides transfers (an estimate).
CALL_SECONDS = 1.0e-3
#: A device iteration's synchronisation with the host: the IPU waits at the start of
#: each step of PopART's main loop until the host has serviced the step's streams
#: (even with synthetic data; counted in the device's run). Fitted to one case of
#: the validation set (``bench/validation.py``: the tutorial CNN, synthetic data).
STEP_SYNC_SECONDS = 85e-6
#: Bytes per second one host process copies into the input streams' buffers (a
#: single-threaded memory copy of the call's tensors; no public figure): fitted to one
#: case of the validation set (``bench/validation.py``: the tutorial CNN, one replica,
#: real data from its ``DataLoader``).
HOST_COPY_BYTES_PER_S = 2.35e9


@dataclasses.dataclass(frozen=True)
class HostSettings:
    """What decides the host time of a call.

    Attributes:
        micro_batches: micro-batches of one replica per device iteration
            (``gradientAccumulation`` in training, 1 in inference).
        device_iterations: ``deviceIterations``.
        replicas: replicas of this process.
        ipus_per_replica: IPUs of one replica.
        input_bytes: host → device bytes of one micro-batch of one replica.
        output_bytes: device → host bytes of one micro-batch's outputs.
        output_mode: the user outputs' ``OutputMode``.
        output_return_period: the ``EveryN`` period.
        synthetic: ``enableSyntheticData``: no data crosses the host link.
        loader_samples_per_s: the ``DataLoader``'s own rate (``None``: data handed to
            the call, no loader).
        host_processes: host processes the ``replicas`` are spread over, each copying
            its share of the inputs (1: PopTorch's one process; a ``poprun
            --num-instances=N`` run of the same replicas: ``N``).
    """
    micro_batches: int = 1
    device_iterations: int = 1
    replicas: int = 1
    ipus_per_replica: int = 1
    input_bytes: int = 0
    output_bytes: int = 0
    output_mode: OutputMode = OutputMode.All
    output_return_period: int = 1
    synthetic: bool = False
    loader_samples_per_s: Optional[float] = None
    host_processes: int = 1


@dataclasses.dataclass(frozen=True)
class HostTime:
    """Seconds of one call, by part.

    Attributes:
        device: the device's run (all device iterations).
        call: the call's fixed work (:data:`CALL_SECONDS`).
        inputs: host-link transfer and host copies of inputs not hidden behind the
            device.
        outputs: host-link transfer of the returned outputs.
        loading: the ``DataLoader``'s loading of the call's samples.
        samples: samples of one call (all replicas).
        sync: the step synchronisations of the process's replicas beyond the one in
            the device's run.
    """
    device: float
    call: float
    inputs: float
    outputs: float
    loading: float
    samples: int
    sync: float = 0.0

    @property
    def total(self) -> float:
        """Seconds per call as a Python loop of calls measures it."""
        return self.device + self.call + self.inputs + self.outputs + self.loading + \
            self.sync

    @property
    def device_samples_per_second(self) -> float:
        """Samples per second as the device sees it (its run only)."""
        return self.samples / self.device if self.device else 0.0

    @property
    def loop_samples_per_second(self) -> float:
        """Samples per second of a Python loop of calls."""
        return self.samples / self.total if self.total else 0.0


def _returned_micro_batches(s: HostSettings) -> int:
    """Micro-batches of outputs a call returns per replica (docs/semantics.md S-12)."""
    per_call = s.micro_batches * s.device_iterations
    if s.output_mode is OutputMode.All:
        return per_call
    if s.output_mode is OutputMode.EveryN:
        return max(1, s.device_iterations // max(1, s.output_return_period)) * \
            s.micro_batches
    return 1  # Final, Sum


def host_time(device_seconds: float, micro_batch: int, settings: HostSettings
              ) -> HostTime:
    """The time of one call (see the module docstring).

    Args:
        device_seconds: the device's run (``cycleCount() / clock``).
        micro_batch: samples per micro-batch.
        settings: batching, bytes, output mode, loader.

    Returns:
        The :class:`HostTime`.
    """
    s = settings
    replicas = max(1, s.replicas)
    samples = micro_batch * s.micro_batches * s.device_iterations * replicas
    # replicas of one machine share its host link
    per_machine = max(1, min(replicas, IPUS_PER_MACHINE // max(1, s.ipus_per_replica)))
    link = HOST_LINK_BYTES_PER_S / per_machine
    inputs = outputs = 0.0
    if not s.synthetic:
        steps = max(1, s.device_iterations * s.micro_batches)
        # each micro-batch: its host link transfer (per replica, replicas of a machine
        # in parallel) or the process's copies for its replicas, whichever is slower
        copy = s.input_bytes * replicas / max(1, s.host_processes) / HOST_COPY_BYTES_PER_S
        step_in = max(s.input_bytes / link, copy)
        step_device = device_seconds / steps
        # prefetching hides each micro-batch's transfer behind the previous one
        inputs = step_in + (steps - 1) * max(0.0, step_in - step_device)
        outputs = s.output_bytes * _returned_micro_batches(s) / link
    loading = samples / s.loader_samples_per_s if s.loader_samples_per_s else 0.0
    if not math.isfinite(loading):
        loading = 0.0
    per_process = math.ceil(replicas / max(1, s.host_processes))
    sync = (per_process - 1) * max(1, s.device_iterations) * STEP_SYNC_SECONDS
    return HostTime(device_seconds, CALL_SECONDS, inputs, outputs, loading, samples, sync)
