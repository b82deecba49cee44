"""Whether this machine can build the emulated cluster (root and iproute2), and the mark that
skips a test, with the reason, where it cannot."""

from __future__ import annotations

import pytest

from onebit.bench.netns import unavailable_reason

UNAVAILABLE = unavailable_reason()
needs_cluster = pytest.mark.skipif(
    UNAVAILABLE is not None, reason=f"emulated cluster unavailable: {UNAVAILABLE}"
)
