"""Daemon helpers for tests and benchmarks only (`epd demo` needs none of them): a `Daemon`
that can also name its engine processes and measure their CPU use.

Benchmarks import it with tests/ on sys.path (see benchmarks/bench_transport.py)."""

from __future__ import annotations

import contextlib
import os
import time

import grpc
from prometheus_client.parser import text_string_to_metric_families

from epd.proto.v1 import epd_pb2, epd_pb2_grpc
from epd.server.demo import Daemon

TOPOLOGY_TIMEOUT = 5.0  # seconds for the supervisor's GetTopology


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memfds(pid: int, name: str) -> list[int]:
    """Descriptors process `pid` holds on memfds whose name starts with `name` ("epd-ring",
    "epd-counters", "epd-out", "epd-<gid>.comm"): engine shared memory has no file names."""
    out = []
    folder = f"/proc/{pid}/fd"
    try:
        entries = os.listdir(folder)
    except OSError:
        return out
    for fd in entries:
        try:
            link = os.readlink(os.path.join(folder, fd))
        except OSError:
            continue
        if link.startswith(f"/memfd:{name}"):
            out.append(int(fd))
    return out


def memfd_names(pid: int, prefix: str = "epd-") -> list[str]:
    """The memfds process `pid` holds, by a descriptor (`memfds`) or a mapping, whose names
    start with `prefix`: EPD's shared memory has no file names (client regions
    `epd-client-<pid>-*`, the engine's counter pages, rings, outputs and group memory), so a
    leak is one of these."""
    names: set[str] = set()
    for fd in memfds(pid, prefix):
        with contextlib.suppress(OSError):
            names.add(os.readlink(f"/proc/{pid}/fd/{fd}")[len("/memfd:"):])
    tag = f"/memfd:{prefix}"
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            at = line.find(tag)
            if at >= 0:
                names.add(line[at + len("/memfd:"):].strip())
    return sorted(n.removesuffix(" (deleted)") for n in names)


class HarnessDaemon(Daemon):
    """`epd serve` in a subprocess (demo.Daemon), plus what tests measure about its engines."""

    __test__ = False

    def engine_pid(self, index: int) -> int:
        """The pid of engine `index`, from the supervisor's topology."""
        with grpc.insecure_channel(f"unix://{self.socket_dir}/node.sock") as ch:
            topo = epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(),
                                                         timeout=TOPOLOGY_TIMEOUT)
        return topo.engines[index].pid

    def engine_cpu_fraction(self, index: int, seconds: float) -> float:
        """Share of one core that engine `index` uses over the next `seconds`."""
        pid = self.engine_pid(index)
        c0, t0 = process_cpu_seconds(pid), time.monotonic()
        time.sleep(seconds)
        return (process_cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def samples(daemon: Daemon) -> dict[str, list]:
    """The daemon's /metrics, parsed: samples by series name."""
    status, body = daemon.get("/metrics")
    assert status == 200
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(ss: dict[str, list], name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels` (one must exist)."""
    got = [s.value for s in ss.get(name, []) if all(s.labels.get(k) == v
                                                   for k, v in labels.items())]
    assert got, f"no {name} sample with {labels}; have {[s.labels for s in ss.get(name, [])]}"
    return sum(got)
