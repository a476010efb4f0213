"""raycomp: adaptive gradient compression for data-parallel PyTorch training.

This package is the part that runs inside every training worker; it never needs Ray. What
it exports is the hook API a user calls (:func:`compression_hook` on a DDP model with a
:class:`CompressionState` and a :class:`Plan`) and what a custom compressor needs; Ray Train
users start at :mod:`raycomp.train`. Everything else is internal and may change.
"""

from raycomp._internal.ddp.buckets import bucket_cap_mb
from raycomp._internal.ddp.hook import compression_hook
from raycomp._internal.ddp.state import CompressionState
from raycomp._internal.reduce.stats import LayerStats
from raycomp._internal.wire.ledger import WireLedger
from raycomp._internal.wire.payload import Payload
from raycomp.compressors import COMPRESSORS, Compressor, make_compressor
from raycomp.plan import DENSE, CompressorSpec, LocalMode, Plan

__version__ = "0.2.0"

__all__ = [
    "COMPRESSORS",
    "DENSE",
    "CompressionState",
    "Compressor",
    "CompressorSpec",
    "LayerStats",
    "Payload",
    "LocalMode",
    "Plan",
    "WireLedger",
    "bucket_cap_mb",
    "compression_hook",
    "make_compressor",
]
