"""The armed low-latency tests of test_ll_plain.py again with the engine's poller
(`--ll-chain off`): under MPS the default (`auto`) runs the fixture's members on GPU chains, and
the poller still serves shrink groups, clients off the engine's MPS server, groups over nodes
and members past the engine's chain budget. Outputs exact as on the chain; the engine timed
every call's detection and launch."""

from __future__ import annotations

import pytest

from .conftest import cuda_daemon
from .test_ll_plain import (  # noqa: F401  (collected again here, with this module's daemon)
    test_low_latency_graph_capture_on_first_appearance,
    test_plain_low_latency_calls_through_armed_ops,
    test_two_micro_batches_in_flight,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def daemon():
    yield from cuda_daemon(("--ll-chain", "off"))
