"""A Poison (isolation/poison.py) for a Redis twin a test builds by hand, with the count it keeps, in a registry of its
own: how many entries each reader dropped."""

from __future__ import annotations

from gateway.metrics import GatewayMetrics
from isolation.poison import Poison


class Counted:
    def __init__(self) -> None:
        self._metrics = GatewayMetrics()
        self.poison = Poison(self._metrics.poison_entries)

    def dropped(self, reader: str) -> float:
        found = self._metrics.registry.get_sample_value("bulkhead_poison_entries_total", {"reader": reader})
        return found or 0.0
