"""The chains' graphs are instantiated in room the engine made while the device was idle
(server/backends/cuda_chain.GraphReserve): a context's room for live graph executables grows
in steps, and a growth waits for every running kernel, so a chain built while a peer's
low-latency kernel spun for it stalled until that kernel's deadline (docs/DESIGN_NOTES.md,
"Chain instances as CUDA graphs"). Each case runs in a fresh process (a context whose room has
not grown): with the room made first, the default 8 chains' 512 graphs built beside a spinning
kernel take milliseconds; without it (the control) they wait for the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SPIN_SECONDS = 2.0
WORKER = os.path.join(os.path.dirname(__file__), "graph_room_worker.py")


def _run(mode: str) -> dict:
    proc = subprocess.run([sys.executable, WORKER, mode, "8", str(SPIN_SECONDS)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_chain_graphs_built_beside_a_running_kernel_do_not_wait_for_it() -> None:
    got = _run("reserve")
    assert got["graphs"] == 512 and got["spinner_still_ran"], got
    assert got["took_s"] < SPIN_SECONDS / 4, got


def test_without_the_room_they_wait_for_the_kernel() -> None:
    """The control: the same graphs in a context whose room was not made first wait for the
    spinner (if this passes no more, the driver changed and the reserve may be moot)."""
    got = _run("control")
    assert got["graphs"] == 512
    assert got["took_s"] > SPIN_SECONDS / 2 and not got["spinner_still_ran"], got
