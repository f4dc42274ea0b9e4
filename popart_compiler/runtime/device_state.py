"""What a session keeps on the device besides the program (docs/semantics.md S-27, S-36, S-44,
S-95): the device copies of parameters, buffers and constants (:class:`DeviceWeights`:
per-replica buffers, replica-grouped weights and their host layouts) and the device
random number generator (:class:`DeviceRng`), independent of the host's. Used by
:mod:`.session`.
"""
from __future__ import annotations

import contextlib
import hashlib
import random
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from popart_compiler.enums import VariableRetrievalMode
from popart_compiler.errors import backend_error
from popart_compiler.stages import Executable

__all__ = ["DeviceWeights", "DeviceRng", "device_dtype", "DEVICE_DTYPES"]

#: Host dtypes that the device does not have, and what they become (docs/semantics.md S-44).
DEVICE_DTYPES = {torch.float64: torch.float32, torch.int64: torch.int32}


def device_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a host dtype has on the device (no 64-bit types, docs/semantics.md S-44)."""
    return DEVICE_DTYPES.get(dtype, dtype)


class DeviceRng:
    """The device's random number generator, independent of the host's (docs/semantics.md S-95).

    Kernels draw from PyTorch's default generator of the execution device; around a
    run the session swaps the device state in and the host state back out. Process
    ``p > 0`` of a multi-process run (``stream = p``) seeds its generator from
    ``(seed, p)`` so that its replicas draw other numbers than process 0's.
    """

    def __init__(self, seed: Optional[int], device: str, stream: int = 0):
        self.device = device
        self.seed = seed if seed is not None else random.SystemRandom().randrange(2 ** 63)
        self.stream = stream
        self.state: Optional[torch.Tensor] = None

    def _get(self) -> torch.Tensor:
        if self.device.startswith("cuda"):
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def reseed(self, seed: int) -> None:
        self.seed = int(seed)
        gen = torch.Generator(device=self.device)
        if self.stream:
            digest = hashlib.sha256(f"{self.seed}/{self.stream}".encode()).digest()
            gen.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        else:
            gen.manual_seed(self.seed)
        self.state = gen.get_state()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        if self.state is None:
            self.reseed(self.seed)
        host = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(host)

    def to_list(self) -> List[int]:
        if self.state is None:
            self.reseed(self.seed)
        return [int(self.seed)] + self.state.tolist()

    def check(self, values: Sequence[int]) -> None:
        """Raise ``Error`` unless ``values`` is ``[seed]`` or ``[seed, *state]`` as
        returned by :meth:`to_list` for this device's generator."""
        try:
            ints = [int(v) for v in values]
            if not ints:
                raise ValueError("empty")
            if len(ints) > 1:
                torch.Generator(device=self.device).set_state(
                    torch.tensor(ints[1:], dtype=torch.uint8))
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise backend_error(
                "Invalid RNG state: expected [seed] or a list read from the executor's "
                f"rng_state property ({e}).") from None

    def from_list(self, values: Sequence[int]) -> None:
        self.check(values)
        self.reseed(int(values[0]))
        if len(values) > 1:
            self.state = torch.tensor(list(values[1:]), dtype=torch.uint8)


class DeviceWeights:
    """Device copies of parameters, buffers and constants.

    Buffers have one copy per replica when replicas must keep their own
    (``broadcast_buffers`` off with replicas fed different data, docs/semantics.md S-36). A
    replica-grouped parameter (docs/semantics.md S-27) has a leading group dimension on the device;
    each replica sees its group's slice.
    """

    def __init__(self, exe: Executable, device: str):
        g = exe.graph
        o = exe.options
        values = g.state_values()
        self.device = device
        self.names = list(g.parameters) + list(g.buffers)
        #: replicas of all processes: grouped weights are laid out over them
        #: (docs/semantics.md S-27, docs/semantics.md S-28) and every process holds every group's
        #: value
        self.global_replication = o.global_replicas
        local = slice(o.replica_offset, o.replica_offset + o.replication_factor)
        per_replica = (not o.broadcast_buffers and o.replication_factor > 1)
        self.replicas = o.replication_factor if per_replica else 1
        #: parameter index → (grouping, group of each local replica, group of each
        #: global replica)
        self.grouped: Dict[int, tuple] = {}
        self.params: List[torch.Tensor] = []
        for i, n in enumerate(g.parameters):
            value = self._device_copy(values[n])
            grouping = o.replica_groupings.get(n)
            if grouping is not None:
                # captured with one group's slice; the host writes every group's value
                groups = grouping.groups(self.global_replication)
                shape = g.placeholders[i].meta["val"].shape
                value = torch.zeros((grouping.num_groups(self.global_replication), *shape),
                                    dtype=value.dtype, device=device)
                self.grouped[i] = (grouping, groups[local], groups)
            self.params.append(value)
        for p, trainable in zip(self.params, g.trainable):
            p.requires_grad_(bool(trainable and exe.training))
        self.buffers: List[List[torch.Tensor]] = [
            [self._device_copy(values[n]) for n in g.buffers] for _ in range(self.replicas)]
        self.constants = [self._device_copy(values[n]) for n in g.constants]
        self.mutated_constants = [n in g.mutated_constants for n in g.constants]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.num_params = len(g.parameters)

    def _device_copy(self, value) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            return value
        return value.detach().to(device=self.device, dtype=device_dtype(value.dtype)
                                 if value.dtype == torch.float64 else value.dtype,
                                 copy=True)

    def replica_groups(self) -> Dict[str, List[int]]:
        """Parameter name → group index of each replica, for replica-grouped ones."""
        return {self.names[i]: groups for i, (_, groups, _) in self.grouped.items()}

    def state(self, replica: int) -> List[torch.Tensor]:
        """What replica ``replica`` passes to the graph: parameters (its group's slice
        of grouped ones), its buffers, constants (fresh copies of mutated ones)."""
        consts = [c.clone() if m else c for c, m in zip(self.constants, self.mutated_constants)]
        params = self.params
        if self.grouped:
            params = list(params)
            for i, (_, groups, _) in self.grouped.items():
                params[i] = params[i][groups[replica]]
        return params + self.buffers[replica % self.replicas] + consts

    def _grouped_value(self, name: str, i: int, value: torch.Tensor,
                       target: torch.Tensor) -> torch.Tensor:
        """A host value of a grouped weight in the device layout (one slice per group):
        ``[G, ...]`` as is, or ``[R, ...]`` (AllReplicas, ``R`` global) → the first
        replica of each group."""
        grouping, _, groups = self.grouped[i]
        slice_shape = tuple(target.shape[1:])
        if value.dim() >= 1 and tuple(value.shape[1:]) == slice_shape:
            if value.shape[0] == target.shape[0]:
                return value
            if value.shape[0] == self.global_replication:
                first = [groups.index(k) for k in range(target.shape[0])]
                return value[torch.tensor(first, device=value.device)]
        expected = [target.shape[0]] + list(slice_shape)
        per_replica = grouping.retrieval_mode is VariableRetrievalMode.AllReplicas
        raise backend_error(
            f"Cannot write per-replica weight {name}: shape {list(value.shape)} differs "
            f"from the {expected} expected (one value per replica group stacked on "
            f"dimension 0{', or one per replica' if per_replica else ''})")

    def check(self, values: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Validate host values for :meth:`write` (device layout, known names only).

        Raises:
            Error: a value whose shape differs from the device tensor's.
        """
        out = {}
        for name, value in values.items():
            i = self.index.get(name)
            if i is None:
                continue
            target = self.params[i] if i < self.num_params else \
                self.buffers[0][i - self.num_params]
            if i in self.grouped:
                value = self._grouped_value(name, i, value, target)
            elif tuple(target.shape) != tuple(value.shape):
                raise backend_error(f"Cannot write weight {name}: shape "
                                    f"{list(value.shape)} differs from the device's "
                                    f"{list(target.shape)}")
            out[name] = value
        return out

    def write(self, values: Dict[str, torch.Tensor]) -> None:
        """Host → device by name; unknown names are ignored. Nothing is written if any
        value is invalid (:meth:`check`)."""
        values = self.check(values)
        with torch.no_grad():
            for name, value in values.items():
                i = self.index[name]
                targets = [self.params[i]] if i < self.num_params else \
                    [bufs[i - self.num_params] for bufs in self.buffers]
                for t in targets:
                    t.copy_(value.detach().to(t.dtype))

    def read(self, name: str) -> torch.Tensor:
        """Device → host value of ``name``: replica 0's buffer; a grouped weight in its
        retrieval layout (one slice per group, or per replica of all processes for
        AllReplicas)."""
        i = self.index[name]
        if i >= self.num_params:
            return self.buffers[0][i - self.num_params].detach()
        t = self.params[i].detach()
        if i in self.grouped:
            grouping, _, groups = self.grouped[i]
            if grouping.retrieval_mode is VariableRetrievalMode.AllReplicas:
                t = t[torch.tensor(groups, device=t.device)]
        return t
