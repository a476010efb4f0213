"""Renamed: the byte counter is :mod:`raycomp.ledger`. Kept so old imports keep working."""

from raycomp.ledger import WireLedger

__all__ = ["WireLedger"]
