"""The mark for tests of semoe's compiled CPU kernels themselves: skipped, with the reason, on an
install without them (no C compiler with OpenMP; `SEMOE_CPU_KERNELS=off`), where everything else runs
on torch's ops and the rest of the suite still checks it."""

from __future__ import annotations

import pytest

from semoe.kernels import loader

needs_kernels = pytest.mark.skipif(loader.library() is None,
                                   reason=f"semoe's compiled CPU kernels are {loader.status()}")
