"""Running totals of the bytes this rank put on the wire, and what dense would have cost."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["WireLedger"]


class WireLedger:
    """Totals per layer and overall. See ``raycomp._internal.transports`` for how bytes are counted."""

    def __init__(self) -> None:
        self.wire_bytes: dict[str, float] = defaultdict(float)
        self.dense_bytes: dict[str, float] = defaultdict(float)

    def add(self, layer: str, wire: float, dense: float = 0.0) -> None:
        self.wire_bytes[layer] += wire
        self.dense_bytes[layer] += dense

    @property
    def wire_total(self) -> float:
        return sum(self.wire_bytes.values())

    @property
    def dense_total(self) -> float:
        return sum(self.dense_bytes.values())

    @property
    def compression_ratio(self) -> float | None:
        """dense / wire over everything counted so far (None before any traffic)."""
        wire = self.wire_total
        return self.dense_total / wire if wire > 0 else None

    def state_dict(self) -> dict[str, Any]:
        return {"wire_bytes": dict(self.wire_bytes), "dense_bytes": dict(self.dense_bytes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wire_bytes = defaultdict(float, state["wire_bytes"])
        self.dense_bytes = defaultdict(float, state["dense_bytes"])
