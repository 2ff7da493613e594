"""crc32c_combine against crc32c of the concatenation."""

import os
import random

import crc32c
import pytest

from storage.crc_combine import crc32c_combine


@pytest.mark.parametrize("len_a,len_b", [(0, 5), (5, 0), (1, 1), (7, 4096), (4096, 1000003), (1 << 20, 3 << 20)])
def test_combine_equals_crc_of_concatenation(len_a, len_b):
    a, b = os.urandom(len_a), os.urandom(len_b)
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len_b) == crc32c.crc32c(a + b)


def test_many_uneven_pieces_fold_to_the_whole():
    rng = random.Random(0)
    data = os.urandom(300_001)
    cuts = sorted(rng.sample(range(1, len(data)), 9))
    crc = 0
    for start, end in zip([0] + cuts, cuts + [len(data)]):
        crc = crc32c_combine(crc, crc32c.crc32c(data[start:end]), end - start)
    assert crc == crc32c.crc32c(data)
    assert crc32c_combine(crc32c.crc32c(data), crc32c.crc32c(b"x"), 1) != crc32c.crc32c(data + b"y")
