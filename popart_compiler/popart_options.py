"""The PopART session options the IPU Model's estimate and PopTorch's implicit defaults
act on, as typed values (:class:`PopartOptions`, the ``popart`` field of
:class:`~popart_compiler.session_options.SessionOptions`).

They are read once from the option dictionary (``poptorch.Options().toDict()``, with
``_Popart.set`` keys) where the session options are built
(:meth:`SessionOptions.from_dict
<popart_compiler.session_options.SessionOptions.from_dict>`); nothing downstream reads
the dictionary for them. An option the user left unset is ``None`` where PopTorch's
compiler may set it (:mod:`popart_compiler.implicit_defaults`, which records the
defaults it sets here too).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, FrozenSet, Mapping, Optional

from popart_compiler.popart_enums import RecomputationType

__all__ = ["PopartOptions", "TensorLocation", "LOCATION_KEYS"]

#: The four tensor-location option groups (``Options.TensorLocations``), which are also
#: the names of :class:`PopartOptions`' location fields.
LOCATION_KEYS = ("location_activation", "location_weight", "location_optimizer",
                 "location_accumulator")


@dataclasses.dataclass(frozen=True)
class TensorLocation:
    """One ``TensorLocationSettings`` (PopTorch's ``Options.TensorLocations``,
    ``poptorch.TensorLocationSettings``).

    Attributes:
        on_chip: ``useOnChipStorage``; ``None``: not chosen (the tensors stay on chip
            unless PopTorch's compiler moves them, e.g. for phased execution).
        sharded: ``useReplicatedTensorSharding``.
        min_off_chip: ``minElementsForOffChip`` (elements).
        min_sharding: ``minElementsForReplicatedTensorSharding`` (elements).
    """
    on_chip: Optional[bool] = None
    sharded: bool = False
    min_off_chip: int = 0
    min_sharding: int = 0

    @classmethod
    def from_dict(cls, values: Optional[Mapping[str, Any]]) -> "TensorLocation":
        """The location of an option dictionary's ``location_*`` entry (``None``: the
        default location)."""
        values = values or {}
        on_chip = values.get("onChip")
        return cls(on_chip=None if on_chip is None else bool(on_chip),
                   sharded=bool(values.get("useReplicatedTensorSharding", 0)),
                   min_off_chip=int(values.get("minElementsForOffChip", 0)),
                   min_sharding=int(values.get("minElementsForReplicatedTensorSharding", 0)))


@dataclasses.dataclass(frozen=True)
class PopartOptions:
    """The PopART options of a session that change the IPU Model's memory and cycles.

    Attributes:
        auto_recomputation: ``autoRecomputation``; ``None``: unset (PopTorch's
            compiler sets ``Pipeline`` for a pipeline over several IPUs, which is what
            the estimate assumes when it stays unset).
        explicit_recomputation: ``explicitRecomputation``.
        enable_pipelining: ``enablePipelining``; ``None``: unset (pipelined execution
            pipelines).
        rng_state: ``enableLoadAndOffloadRNGState``; ``None``: unset (on, PopTorch's
            default).
        location_activation / location_weight / location_optimizer /
            location_accumulator: the tensor locations (:class:`TensorLocation`).
        available_memory: IPU → ``setAvailableMemoryProportion`` value (0 to 1).
        half_partials_matmul: ``partialsTypeMatMuls`` is ``"half"``.
        half_partials_conv: ``convolutionOptions["partialsType"]`` is ``"half"``.
        io_tiles: ``numIOTiles`` (tiles per IPU set aside for IO; default 0).
        set_keys: the backend options that hold a value, the user's and then those
            PopTorch's compiler set (engine options as ``engineOptions[<name>]``):
            PopTorch sets an option only if it is not set yet.
    """
    auto_recomputation: Optional[RecomputationType] = None
    explicit_recomputation: bool = False
    enable_pipelining: Optional[bool] = None
    rng_state: Optional[bool] = None
    location_activation: TensorLocation = TensorLocation()
    location_weight: TensorLocation = TensorLocation()
    location_optimizer: TensorLocation = TensorLocation()
    location_accumulator: TensorLocation = TensorLocation()
    available_memory: Dict[int, float] = dataclasses.field(default_factory=dict)
    half_partials_matmul: bool = False
    half_partials_conv: bool = False
    io_tiles: int = 0
    set_keys: FrozenSet[str] = frozenset()

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> "PopartOptions":
        """Read the options from an option dictionary (``Options.toDict()``).

        Raises:
            ValueError: ``autoRecomputation`` is no ``RecomputationType`` value (the
                dictionary's validation refuses it first, see ``SessionOptions``).
        """
        def optional_bool(key: str) -> Optional[bool]:
            return None if raw.get(key) is None else bool(raw[key])

        recompute = raw.get("autoRecomputation")
        conv = raw.get("convolutionOptions") or {}
        engine = raw.get("engineOptions") or {}
        return cls(
            auto_recomputation=None if recompute is None else
            RecomputationType(int(recompute)),
            explicit_recomputation=bool(raw.get("explicitRecomputation", False)),
            enable_pipelining=optional_bool("enablePipelining"),
            rng_state=optional_bool("enableLoadAndOffloadRNGState"),
            **{key: TensorLocation.from_dict(raw.get(key)) for key in LOCATION_KEYS},
            available_memory={int(k): float(v) for k, v in
                              (raw.get("available_memory_proportion") or {}).items()},
            half_partials_matmul=str(raw.get("partialsTypeMatMuls", "float")).lower()
            == "half",
            half_partials_conv=str(conv.get("partialsType", "float")).lower() == "half",
            io_tiles=int(raw.get("numIOTiles", 0) or 0),
            set_keys=frozenset([k for k, v in raw.items() if v is not None]
                               + [f"engineOptions[{name}]" for name in engine]))

    def location(self, key: str) -> TensorLocation:
        """The location of ``key``, one of :data:`LOCATION_KEYS`."""
        return getattr(self, key)
