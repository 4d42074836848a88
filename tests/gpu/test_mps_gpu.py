"""CUDA MPS with the real `nvidia-cuda-mps-control` and the CUDA engine (issue 10, item 5):
`epd serve --backend cuda --mps on` starts a private MPS server, a client under `epd env`'s
environment is on it (and listed as its client), a client off it still works (warned), and the
server is gone once the daemon stops. Skipped without a GPU or without the MPS binary."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import grpc
import pytest

from epd.proto.v1 import epd_pb2, epd_pb2_grpc
from epd.server import mps
from epd.server.demo import Daemon

from .conftest import DAEMON_TIMEOUT, GPU_COUNT

pytestmark = pytest.mark.gpu

# One client process (CUDA must start after its environment is set): a session on engine 0, a
# one-rank group, dispatch + combine of torch CUDA tensors checked bit for bit, and the MPS
# servers' client lists as nvidia-cuda-mps-control reports them. Prints one JSON line.
CLIENT = r'''
import json, os, subprocess, sys, warnings
import torch
from epd.client import Session
from epd.client.mps import MpsWarning

socket = sys.argv[1]
torch.cuda.set_device(0)
x = torch.randn(64, 256, device="cuda").to(torch.bfloat16)
idx = torch.stack([torch.arange(64) % 8, (torch.arange(64) + 1) % 8], 1).to("cuda")
w = torch.full((64, 2), 0.5, device="cuda")
res = {"pid": os.getpid()}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", MpsWarning)
    s = Session(socket, client_name="mps-gpu-test", timeout=30)
res["warned"] = [str(c.message) for c in caught if issubclass(c.category, MpsWarning)]
with s:
    res["on_engine_mps"] = s.on_engine_mps
    res["engine_pipe"] = s.mps_pipe_directory
    g = s.join("mps-gpu", rank=0, num_ranks=1, num_experts=8, hidden=256,
               max_tokens_per_rank=64, num_topk=2, timeout=30)
    out = g.dispatch(x, idx, w)
    cx, _ = g.combine(out.recv_x, out.handle, topk_weights=out.recv_topk_weights)
    torch.cuda.synchronize()
    res["dispatch_exact"] = bool(torch.equal(out.recv_x.view(torch.int16), x.view(torch.int16)))
    res["combine_exact"] = bool(torch.equal(cx.view(torch.int16), x.view(torch.int16)))
    clients = []
    pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "")
    if pipe:
        ask = lambda text: subprocess.run(["nvidia-cuda-mps-control"], input=text, text=True,
                                          capture_output=True, timeout=10).stdout.split()
        for server in ask("get_server_list\n"):
            clients += [int(p) for p in ask(f"get_client_list {server}\n") if p.isdigit()]
    res["mps_clients"] = clients
print(json.dumps(res))
'''


@pytest.fixture(scope="module")
def mps_daemon():
    if shutil.which(mps.CONTROL_BINARY) is None:
        pytest.skip(f"{mps.CONTROL_BINARY} is not on PATH")
    # No node server may be picked up: point the pipe folder in effect at an empty folder, so
    # --mps on starts a private server.
    empty = tempfile.mkdtemp(prefix="epd-no-mps-")
    old = os.environ.get(mps.PIPE_ENV)
    os.environ[mps.PIPE_ENV] = empty
    try:
        d = Daemon(backend="cuda", engines=GPU_COUNT, timeout_seconds=DAEMON_TIMEOUT,
                   extra=["--nvshmem-heap-bytes", str(2 << 30), "--mps", "on"])
    finally:
        if old is None:
            os.environ.pop(mps.PIPE_ENV, None)
        else:
            os.environ[mps.PIPE_ENV] = old
    try:
        d.wait_ready(180)
    except Exception:
        print(d.log())
        d.stop()
        shutil.rmtree(empty, ignore_errors=True)
        raise
    yield d
    print(d.log()[-4000:])
    d.stop()
    shutil.rmtree(empty, ignore_errors=True)


def _topology(d: Daemon) -> epd_pb2.GetTopologyResponse:
    with grpc.insecure_channel(f"unix://{d.socket_dir}/node.sock") as ch:
        return epd_pb2_grpc.NodeStub(ch).GetTopology(epd_pb2.GetTopologyRequest(), timeout=5)


def _client(d: Daemon, pipe: str) -> dict:
    env = {**os.environ, mps.PIPE_ENV: pipe}
    res = subprocess.run([sys.executable, "-c", CLIENT, d.socket(0)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr + d.log()[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _epd_env(d: Daemon) -> dict[str, str]:
    """What `eval "$(epd env)"` would export."""
    res = subprocess.run([sys.executable, "-m", "epd.server.cli", "env", "--socket-dir",
                          d.socket_dir], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    out = {}
    for line in res.stdout.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            out[key] = value
    return out


def test_private_server_and_a_client_on_it(mps_daemon):
    d = mps_daemon
    t = _topology(d)
    pipe = os.path.join(d.socket_dir, "mps", "pipe")
    assert (t.mps_mode, t.mps_pipe_directory) == ("private", pipe)
    assert mps.control_pid(pipe) is not None
    print("MPS pipe folder:", sorted(os.listdir(pipe)))
    exports = _epd_env(d)
    # (epd env names the daemon's folder too: e85b869)
    assert exports == {mps.PIPE_ENV: pipe, "EPD_SOCKET_DIR": os.path.abspath(d.socket_dir)}
    res = _client(d, exports[mps.PIPE_ENV])
    assert res["on_engine_mps"] and res["engine_pipe"] == pipe and not res["warned"], res
    assert res["dispatch_exact"] and res["combine_exact"], res
    engine = t.engines[0].pid
    assert res["pid"] in res["mps_clients"] and engine in res["mps_clients"], res


def test_a_client_off_the_server_works_and_is_warned(mps_daemon, tmp_path):
    d = mps_daemon
    res = _client(d, str(tmp_path))  # no MPS server there: CUDA runs without MPS
    assert not res["on_engine_mps"] and len(res["warned"]) == 1, res
    assert res["dispatch_exact"] and res["combine_exact"], res
    assert "not on engine 0's CUDA MPS server" in d.log()


def test_the_private_server_is_gone_after_stop(mps_daemon):
    """Last in the module: stops the module's daemon (the fixture's stop is then a no-op)."""
    d = mps_daemon
    pipe = os.path.join(d.socket_dir, "mps", "pipe")
    server = mps.control_pid(pipe)
    assert server is not None
    d.proc.terminate()
    assert d.proc.wait(60) == 0, d.log()[-4000:]
    assert not os.path.exists(os.path.join(d.socket_dir, "mps"))
    assert not mps._alive(server)
    assert os.listdir(d.socket_dir) == [], os.listdir(d.socket_dir)
    assert "private control daemon stopped" in d.log()
