"""crc32c of a concatenation from the crc32c of its parts, so one tensor can be read and checked
as several pieces in parallel.

crc(A || B) = shift(crc(A), len(B)) xor crc(B), where shift appends len(B) zero bytes to the
register: a linear map over GF(2), i.e. a 32x32 bit matrix, built by repeated squaring (the method
zlib uses for crc32_combine) and cached per length, since a file's pieces have few distinct sizes.
"""

from __future__ import annotations

from functools import lru_cache

import crc32c as _crc32c
import numpy as np

_POLY = 0x82F63B78  # crc32c (Castagnoli), reflected


def _times(mat: tuple[int, ...], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(_times(mat, mat[i]) for i in range(32))


@lru_cache(maxsize=256)
def _shift_operator(nbytes: int) -> tuple[int, ...]:
    """The matrix that appends `nbytes` zero bytes to a crc32c register."""
    odd = [_POLY] + [1 << i for i in range(31)]  # one zero bit
    op = _square(_square(tuple(odd)))  # four zero bits
    result: tuple[int, ...] | None = None
    n = nbytes
    while n:
        op = _square(op)  # 8, 16, 32, ... zero bits: a byte, two bytes, four bytes, ...
        if n & 1:
            result = op if result is None else tuple(_times(op, result[i]) for i in range(32))
        n >>= 1
    return result if result is not None else tuple(1 << i for i in range(32))


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """crc32c of A || B from crc32c(A), crc32c(B) and len(B)."""
    if len_b == 0:
        return crc_a
    return _times(_shift_operator(len_b), crc_a) ^ crc_b


def crc32c(data: bytes | memoryview | np.ndarray, value: int = 0) -> int:
    """crc32c of a buffer (hardware-accelerated where the CPU has it), continued from `value` (the
    crc32c of the bytes before it)."""
    return _crc32c.crc32c(memoryview(data).cast("B") if not isinstance(data, bytes) else data, value)
