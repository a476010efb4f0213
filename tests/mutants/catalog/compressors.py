"""Compressors and bit packing: what each sends and how it decodes."""

from ..mutant import mutant

MUTANTS = (
    mutant(
        "randomk-ranks-draw-different-indices", "RandomK.shared_randomness",
        "    shared_randomness = True\n",
        "    shared_randomness = False\n",
        "tests/test_collectives.py",
        "Random-K seeds its indices per rank: the all-reduce sums values of different coordinates",
    ),
    mutant(
        "topk-picks-smallest", "TopK._compress",
        "        indices = torch.topk(flat.abs(), k, sorted=False).indices\n",
        "        indices = torch.topk(flat.abs(), k, largest=False, sorted=False).indices\n",
        "tests/test_compressors.py",
        "Top-K keeps the k smallest magnitudes",
    ),
    mutant(
        "sparse-decompress-off-by-one", "scatter_dense",
        "    out.index_put_((indices.long(),), values.to(payload.dtype), accumulate=True)\n",
        "    out.index_put_(((indices.long() + 1) % payload.numel,), values.to(payload.dtype), accumulate=True)\n",
        "tests/test_compressors.py",
        "sparse decompress scatters every value one position too far",
    ),
    mutant(
        "int4-codes-a-byte-each", "MinMaxInt8._compress",
        "        per_byte = 8 // self.bits\n        packed = torch.empty(packed_nbytes(n, self.bits),",
        "        per_byte = 1\n        packed = torch.empty(n,",
        "tests/test_compressors.py tests/test_wire.py",
        "int4 sends a whole byte per 4-bit code",
    ),
    mutant(
        "int8-scale-wrong", "MinMaxInt8.decompress",
        "low) / (2**self.bits - 1)).add_(low)\n",
        "low) / 2**self.bits).add_(low)\n",
        "tests/test_compressors.py",
        "int8 dequantisation uses 256 steps where quantisation used 255",
    ),
    mutant(
        "minmax-odd-count-keeps-padding-code", "MinMaxInt8._compress",
        "            count = min(stop * self.chunk_size, n) - first  # the last chunk's padding is not sent\n",
        "            count = min(stop * self.chunk_size, n + n % 2) - first\n",
        "tests/test_compressors.py",
        "int4 with an odd element count sends the padding's code in the last byte's high half",
    ),
    mutant(
        "minmax-blocks-at-int4-offsets", "MinMaxInt8._compress",
        "            written = packed[first // per_byte: first // per_byte + packed_nbytes(count, self.bits)]\n",
        "            written = packed[first // 2: first // 2 + packed_nbytes(count, self.bits)]\n",
        "tests/test_compressors.py",
        "each encoding block's bytes are written at int4's offsets, also for int8 (blocks overlap)",
    ),
    mutant(
        "sign-scale-l2", "ScaledSign._compress",
        "vector_norm(flat.float(), ord=1)",
        "vector_norm(flat.float(), ord=2)",
        "tests/test_compressors.py",
        "scaled sign uses the L2 norm / N as its scale instead of the mean magnitude",
    ),
    mutant(
        "bitpack-pairs-high-code-dropped", "pack_codes_into",
        "        return out.copy_(v.bitwise_or(v >> 4))\n",
        "        return out.copy_(v)\n",
        "tests/test_bitpack.py",
        "4-bit codes paired through int16 keep only each pair's first code",
    ),
    mutant(
        "bitpack-pairs-odd-tail-not-zeroed", "pack_codes_into",
        "        pairs[n:].zero_()  # an odd count's last byte: a zero code in the high half\n",
        "        pairs[n:].fill_(9)\n",
        "tests/test_bitpack.py",
        "an odd count of 4-bit codes leaves a nonzero code in the last byte's high half",
    ),
    mutant(
        "bitpack-unpairs-without-mask", "unpack_bits_into",
        "        pairs.bitwise_or_(pairs << 4).bitwise_and_(0x0F0F)\n",
        "        pairs.bitwise_or_(pairs << 4)\n",
        "tests/test_bitpack.py",
        "4-bit unpacking through int16 leaves the neighbouring code's bits in each code",
    ),
    mutant(
        "bitpack-shift-off-by-one", "pack_bits",
        "        out |= grid[:, i] << (i * bits)\n",
        "        out |= grid[:, i] << (i * bits - 1)\n",
        "tests/test_bitpack.py",
        "multi-bit packing puts codes 2.. one bit too low",
    ),
    mutant(
        "qsgd-always-rounds-down", "QSGD._compress",
        "        level = (scaled + noise).floor_().clamp_(max=self.levels)",
        "        level = (scaled + 0 * noise).floor_().clamp_(max=self.levels)",
        "tests/test_compressors.py",
        "QSGD drops the stochastic rounding: biased",
    ),
)
