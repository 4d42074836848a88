"""Issue 12, the multi-user test: the daemon runs as its own uid; two client uids in the socket
group use it (umask 022: finding 14), an outsider cannot connect, and a client of one uid cannot
join a group of the other uid (names are each uid's own) unless `--allow-uids` lists both.
Needs root (to take the uids).

The interpreter may live where other uids cannot reach it (/root/.pyenv under a 0700 /root):
then every process of this test keeps CAP_DAC_READ_SEARCH (ambient), which lets it read and
search but never write or connect where its uid may not; the access checks under test (socket
connect needs write permission, regions need read-write) are unchanged by it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

from epd.server.demo import _free_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the multi-user test needs root "
                                                            "(it runs processes as other uids)")

DAEMON, USER_A, USER_B, OUTSIDER, SOCKET_GROUP = 41001, 41002, 41003, 41004, 41010
TESTS = os.path.dirname(os.path.abspath(__file__))

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_KEEPCAPS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE = 8, 47, 2
CAP_DAC_READ_SEARCH = 2
_CAP_V3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _reachable_by_others(path: str) -> bool:
    path = os.path.realpath(path)
    while path != "/":
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & 0o001:
            return False
    return True


KEEP_READ_SEARCH = not all(_reachable_by_others(p) for p in (sys.executable, os.__file__))


def become(uid: int, gid: int, groups: list[int]):
    """preexec_fn: drop to uid/gid/groups (keeping only CAP_DAC_READ_SEARCH when needed)."""
    def pre() -> None:
        if KEEP_READ_SEARCH:
            _libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
        os.setgroups(groups)
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if KEEP_READ_SEARCH:
            bit = 1 << CAP_DAC_READ_SEARCH
            data = (_CapData * 2)()
            data[0].effective = data[0].permitted = data[0].inheritable = bit
            if _libc.capset(ctypes.byref(_CapHeader(_CAP_V3, 0)), data) != 0:
                os._exit(97)
            if _libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0):
                os._exit(98)
    return pre


CLIENT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import ranklib
from epd.client import EpdError, Session
sock, group, rank, nranks = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
c = ranklib.Case(group=group, num_ranks=nranks, num_experts=4 * nranks, hidden=128, num_topk=2,
                 tokens=(12,) * nranks, use_empty=True)
try:
    with Session(sock, timeout=4) as s:
        g = ranklib.join(s, c, rank)
        res = ranklib.case_round(s, g, c, rank)
        want = ranklib.reference(c)  # (this rank's part, bit for bit)
        ranklib.assert_exact(res["recv_x"], want["disp"][rank].recv_x, "recv_x")
        ranklib.assert_exact(res["combined_x"], want["comb"][rank][0], "combined_x")
        print(json.dumps({"code": "OK", "endpoint": s.endpoint, "engine": s.engine_index}))
except EpdError as e:
    print(json.dumps({"code": e.code.name, "details": e.details}))
"""


class UserDaemon:
    def __init__(self, extra: list[str]) -> None:
        self.base = tempfile.mkdtemp(prefix="epd-mu-")
        os.chmod(self.base, 0o755)
        self.sock = os.path.join(self.base, "sock")
        os.mkdir(self.sock)
        os.chown(self.sock, DAEMON, SOCKET_GROUP)
        os.chmod(self.sock, 0o750)
        self.shm = tempfile.mkdtemp(prefix="epd-mu-", dir="/dev/shm")
        os.chown(self.shm, DAEMON, DAEMON)
        self.port = _free_port()
        env = dict(os.environ)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.log = open(os.path.join(self.base, "daemon.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "epd.server.cli", "serve", "--backend", "cpu", "--engines",
             "2", "--socket-dir", self.sock, "--shm-dir", self.shm, "--metrics-port",
             str(self.port), "--timeout-seconds", "3", "--drain-seconds", "2", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
            preexec_fn=become(DAEMON, SOCKET_GROUP, [SOCKET_GROUP]))
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, self.text()
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{self.port}/readyz", timeout=2) as r:
                if r.status == 200:
                    break
            assert time.monotonic() < deadline, self.text()
            time.sleep(0.1)

    def text(self) -> str:
        with open(self.log.name) as f:
            return f.read()

    def dispatch_groups(self) -> set[str]:
        """The `group` labels of the daemon's dispatch latency series."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return {line.split('group="', 1)[1].split('"', 1)[0] for line in text.splitlines()
                if line.startswith("epd_dispatch_seconds_count{")}

    def socket(self, engine: int) -> str:
        return os.path.join(self.sock, f"gpu{engine}.sock")

    def client(self, uid: int, groups: list[int], group: str, rank: int, nranks: int,
               engine: int = 0, socket: str | None = None) -> subprocess.Popen:
        """A client process of `uid` that runs one round of `group` as `rank` (on engine
        `engine`'s socket, or the socket file `socket` of the folder); its result's code,
        endpoint and engine (result())."""
        path = os.path.join(self.sock, socket) if socket else self.socket(engine)
        return subprocess.Popen(
            [sys.executable, "-c", CLIENT, TESTS, path, group, str(rank), str(nranks)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=become(uid, uid, groups), umask=0o022)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(30)
            left = os.listdir(self.shm)
            assert self.proc.returncode == 0, self.text()[-3000:]
            assert left == [], left
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.log.close()
            shutil.rmtree(self.base, ignore_errors=True)
            shutil.rmtree(self.shm, ignore_errors=True)


def result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=60)
    lines = out.strip().splitlines()
    assert lines, f"client printed nothing (rc {p.returncode}):\n{err[-3000:]}"
    return json.loads(lines[-1])


def test_multi_user() -> None:
    d = UserDaemon([])
    try:
        # Two users of the socket group, umask 022, each with its own group: both work.
        a = d.client(USER_A, [SOCKET_GROUP], "mu-solo-a", 0, 1)
        b = d.client(USER_B, [SOCKET_GROUP], "mu-solo-b", 0, 1, engine=1)
        assert result(a)["code"] == "OK"
        assert result(b)["code"] == "OK"
        # Two users' groups of one name are two groups, and two series: their metrics'
        # group label carries the owner's uid (the daemon's own uid's would not).
        a = d.client(USER_A, [SOCKET_GROUP], "mu-same", 0, 1)
        b = d.client(USER_B, [SOCKET_GROUP], "mu-same", 0, 1, engine=1)
        assert result(a)["code"] == "OK"
        assert result(b)["code"] == "OK"
        labels = d.dispatch_groups()
        assert {f"mu-same (uid {USER_A})", f"mu-same (uid {USER_B})",
                f"mu-solo-a (uid {USER_A})"} <= labels, labels
        assert "mu-same" not in labels, labels
        # An outsider cannot even connect.
        o = result(d.client(OUTSIDER, [], "mu-out", 0, 1))
        assert o["code"] == "UNAVAILABLE", o
        # A group name of user A: user B's join of it forms B's own group (names are each
        # uid's own; B learns nothing of A's), so both miss their peer.
        a = d.client(USER_A, [SOCKET_GROUP], "mu-shared", 0, 2)
        time.sleep(1.5)
        b = result(d.client(USER_B, [SOCKET_GROUP], "mu-shared", 1, 2, engine=1))
        assert b["code"] == "DEADLINE_EXCEEDED", b
        assert f"uid {USER_A}" not in b["details"], b
        assert result(a)["code"] == "DEADLINE_EXCEEDED"
    finally:
        d.close()
    d = UserDaemon(["--allow-uids", f"{USER_A},{USER_B}"])  # (a pool lists its every uid)
    try:
        a = d.client(USER_A, [SOCKET_GROUP], "mu-shared", 0, 2)
        time.sleep(1.0)
        b = d.client(USER_B, [SOCKET_GROUP], "mu-shared", 1, 2, engine=1)
        assert result(a)["code"] == "OK"
        assert result(b)["code"] == "OK"
        # (a pool's one namespace: one group, labelled as the pool's)
        assert "mu-shared (pool)" in d.dispatch_groups()
    finally:
        d.close()
