"""Old import path of the split/merge, packing and random-bit helpers (kept so existing imports work).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1. The code now
lives in one module per idea: ``formats`` (the 16-bit formats, Table 1), ``packing`` (dense int32
words, Fig 1, and byte planes), ``rng`` (random bits for stochastic rounding) and ``split_merge``
(fp32 <-> 16-bit value + extra bits). Import from those; this module only re-exports their names.
"""

from .formats import SUPPORTED_DTYPES, check_format, max_extra_bits, relative_bound, significand_bits, storage_bits
from .packing import decode, encode, extra_storage, is_byte_aligned, pack, packed_words, store_into, unpack
from .rng import hash_noise, mix_key, sr_noise
from .split_merge import merge, merge_values, split, split_values, stochastic_round

__all__ = [
    "SUPPORTED_DTYPES",
    "max_extra_bits",
    "significand_bits",
    "storage_bits",
    "packed_words",
    "pack",
    "unpack",
    "is_byte_aligned",
    "extra_storage",
    "encode",
    "decode",
    "hash_noise",
    "split",
    "merge",
    "split_values",
    "merge_values",
    "stochastic_round",
    "sr_noise",
    "mix_key",
    "store_into",
    "check_format",
    "relative_bound",
]
