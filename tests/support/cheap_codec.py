"""A user's compressor, declared so the adaptive policy can rank it: 2-bit min-max
quantization (three steps between each chunk's minimum and maximum), a quarter byte per
element. It travels in the scalable transport's batch like int8 and int4, and says so in
its :class:`~raycomp.compressors.Cost` (inherited from :class:`MinMaxInt8`: near-lossless,
family "quantized"), so the policy offers it as a near-lossless rung. That is its author's claim:
four levels per chunk leave about 0.7 relative error on a Gaussian, and the policy judges
its measured error like any other rung's (``max_error``). Register it by import path::

    raycomp.compressors.register("int2", "tests.support.cheap_codec:MinMaxInt2")
"""

from __future__ import annotations

from raycomp.compressors.minmax import MinMaxInt8


class MinMaxInt2(MinMaxInt8):
    """:class:`MinMaxInt8` at 2 bits: four codes a byte, ``ceil(N / 4)`` bytes + two fp32
    (min, max) per chunk."""

    name = "int2"
    bits = 2
