"""The armed low-latency tests of test_ll_plain.py again with the GPU chain forced on
(`--ll-chain`, whatever MPS the clients use): the client's trigger kernel publishes each call
in the member's ring and kernels enqueued ahead run it (server/backends/cuda_chain.py).
Outputs exact as with the poller, the engine's host launched none of the calls."""

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
    yield from cuda_daemon(("--ll-chain",))
