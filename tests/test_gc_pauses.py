"""The engine's collector settings (server/engine/gc_pauses.py), each in a fresh interpreter:
gc.freeze is process-wide and would change this test process."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import gc, sys
from epd.server import metrics
from epd.server.engine import gc_pauses
freeze = sys.argv[1] == "1"
gc_pauses.install(freeze)
gc_pauses.install(freeze)  # (idempotent: one callback)
garbage = []
garbage.append(garbage)  # a cycle only the collector frees
del garbage
gc.collect(2)
gc_pauses.flush()
hist = {s.name: s.value for m in metrics.ENGINE_GC_PAUSE_SECONDS.collect() for s in m.samples
        if s.labels.get("generation") == "2"}
print(gc.get_freeze_count() > 0, hist["epd_engine_gc_pause_seconds_count"],
      sum(cb is gc_pauses._on_gc for cb in gc.callbacks))
"""


@pytest.mark.parametrize("freeze", [True, False])
def test_install_times_collections_and_freezes_on_request(freeze: bool) -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT, "1" if freeze else "0"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    frozen, full_collections, callbacks = out
    assert frozen == str(freeze)
    # install's own full collections (with freeze) and the test's: each timed once
    assert float(full_collections) == (3.0 if freeze else 1.0)
    assert callbacks == "1"


class _Untouchable:
    def __getattr__(self, name: str):
        raise AssertionError(f"the gc callback touched the metric ({name})")


def test_the_callback_takes_no_metric_lock(monkeypatch) -> None:
    # A collection can start while its thread holds prometheus_client's value lock: the callback
    # must only record, and flush() observe later (an engine hung on that lock in the CPU suite).
    from epd.server import metrics
    from epd.server.engine import gc_pauses

    real = metrics.ENGINE_GC_PAUSE_SECONDS
    before = real.labels("7")._sum.get()
    monkeypatch.setattr(metrics, "ENGINE_GC_PAUSE_SECONDS", _Untouchable())
    gc_pauses._on_gc("start", {"generation": 7})
    gc_pauses._on_gc("stop", {"generation": 7, "collected": 0})
    monkeypatch.setattr(metrics, "ENGINE_GC_PAUSE_SECONDS", real)
    gc_pauses.flush()
    assert not gc_pauses._pauses
    assert real.labels("7")._sum.get() > before
