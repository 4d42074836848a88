"""The armed low-latency tests of test_ll_plain.py on each path a member's armed ops can take,
whatever MPS the clients use: the GPU chain forced on (`--ll-chain`: the client's trigger
kernel publishes each call in the member's ring and kernels enqueued ahead run it,
server/backends/cuda_chain.py) and the engine's poller (`--ll-chain off`, which still serves
shrink groups, clients off the engine's MPS server, groups over nodes and members past the
engine's chain budget; under MPS the default `auto` runs test_ll_plain.py's members on
chains). Outputs exact on both; on the chain the engine's host launched none of the calls."""

from __future__ import annotations

import pytest

from .conftest import cuda_daemon
from .test_ll_plain import (  # noqa: F401  (collected again here, with this module's daemon)
    test_low_latency_graph_capture_on_first_appearance,
    test_plain_low_latency_calls_through_armed_ops,
    test_two_micro_batches_in_flight,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[("--ll-chain",), ("--ll-chain", "off")],
                ids=["chain", "poller"])
def daemon(request):
    yield from cuda_daemon(request.param)
