"""server/engine/stall_probe.py: while a watched section runs past the threshold, the other
threads' stacks are counted and written to the file; a short section counts nothing."""

from __future__ import annotations

import json
import threading
import time

from epd.server.engine.stall_probe import StallProbe


def _blocked_elsewhere(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(5)  # (a thread waiting in a C call: its Python line is what the probe sees)


def test_a_long_section_counts_every_other_thread_once_per_stall(tmp_path) -> None:
    path = tmp_path / "stalls.json"
    probe = StallProbe(str(path), threshold=0.03, period=2e-4)  # (a loaded CI host may
    # deschedule a short section for a few ms: the short ones below sleep nothing)
    started, release = threading.Event(), threading.Event()
    other = threading.Thread(target=_blocked_elsewhere, args=(started, release),
                             name="prefill-like")
    other.start()
    started.wait(5)
    try:
        with probe.watch("top_up"):
            pass  # under the threshold: nothing
        with probe.watch("launch"):
            pass
        assert probe.summary()["stalls"] == {}
        for _ in range(2):
            with probe.watch("top_up"):
                time.sleep(0.3)  # over it: one stall each, several looks
    finally:
        release.set()
        other.join()
        probe.stop()
    got = json.loads(path.read_text())
    assert got["stalls"] == {"top_up": 2}
    assert got["looks"] >= 10
    mine = [s for s in got["stacks"] if "| prefill-like |" in s["stack"]]
    assert mine and mine[0]["stack"].startswith("top_up | prefill-like | ")
    assert "_blocked_elsewhere" in mine[0]["stack"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_off_without_the_environment_variable(monkeypatch) -> None:
    monkeypatch.delenv("EPD_STALL_PROBE", raising=False)
    assert StallProbe.from_env() is None
