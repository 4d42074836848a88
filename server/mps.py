"""CUDA MPS for the daemon (`epd serve --mps auto|on|off`).

Without MPS the engine's kernels (daemon process) and a client's CUDA stream (another process)
share each GPU by time slices; under one MPS server they run concurrently (docs/DESIGN_NOTES.md,
"MPS is part of the product"). Modes, as `Mps.mode` and Node.GetTopology report them:

- "off": EPD starts nothing and leaves the environment as the operator gave it.
- "node": an MPS control daemon already serves the pipe folder in effect
  (CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps): the engines use it; it is never stopped.
- "private": the daemon starts `nvidia-cuda-mps-control -d` with its pipe and log folders under
  `<socket-dir>/mps` and quits it at exit, after its engines have stopped.

Every command and every wait has a deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping

from ..proto.v1 import epd_pb2

log = logging.getLogger("epd.mps")

CONTROL_BINARY = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
# What the supervisor tells each engine: the pipe folder of the MPS server it runs on, empty when
# the mode is off (the engine reports it to clients; CUDA_MPS_PIPE_DIRECTORY alone could be an
# operator's setting that EPD does not vouch for).
ENGINE_ENV = "EPD_ENGINE_MPS_PIPE_DIRECTORY"
CONTROL = "control"  # the control daemon's socket in the pipe folder (it outlives the daemon)
PID_FILE = "nvidia-cuda-mps-control.pid"  # in the pipe folder while the control daemon runs
FOLDER = "mps"  # <socket-dir>/mps/{pipe,log}: a private server's folders
COMMAND_SECONDS = 10.0  # one nvidia-cuda-mps-control invocation
START_SECONDS = 10.0  # `-d` until the control daemon's pid file names a live process
STOP_SECONDS = 10.0  # `quit` until the control daemon has exited
KILL_SECONDS = 2.0  # after SIGTERM to a control daemon that ignored `quit`
POLL_SECONDS = 0.05
MODES = ("auto", "on", "off")


class MpsError(Exception):
    """MPS cannot be set up as asked: one line naming the setting and the fix."""


def uses_mps(proto_kind: int) -> bool:
    """Whether a backend's engines run CUDA contexts, the thing MPS serves."""
    return proto_kind == epd_pb2.CUDA


def pipe_directory_in_effect(environ: Mapping[str, str] | None = None) -> str:
    """The pipe folder a CUDA process with this environment would use."""
    environ = os.environ if environ is None else environ
    return environ.get(PIPE_ENV) or DEFAULT_PIPE_DIRECTORY


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not). The control daemon daemonises, so it is our child
    only where this process reaps orphans (PID 1 of a container): reap it then."""
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def control_pid(pipe_directory: str) -> int | None:
    """The pid of the control daemon serving `pipe_directory`, if its pid file names a live
    process (the `control` socket stays behind when the daemon stops, the pid file does not)."""
    try:
        with open(os.path.join(pipe_directory, PID_FILE)) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None
    return pid if pid > 0 and _alive(pid) else None


class Mps:
    """The daemon's MPS setup: `start()` before the engines, `env()` for each engine,
    `stop()` after the engines (a private server only; idempotent)."""

    def __init__(self, requested: str, socket_dir: str, backend: str, proto_kind: int,
                 environ: Mapping[str, str] | None = None) -> None:
        if requested not in MODES:
            raise MpsError(f"--mps {requested}: not one of {', '.join(MODES)}")
        self.requested = requested
        self.backend = backend
        self.cuda = uses_mps(proto_kind)
        self.environ = dict(os.environ if environ is None else environ)
        self.root = os.path.join(socket_dir, FOLDER)
        self.mode = "off"
        self.pipe_directory = ""
        self.log_directory = ""
        self._binary: str | None = None

    # -- decision ----------------------------------------------------------------------------
    def start(self) -> None:
        """Decide the mode and start a private server if needed; MpsError when `--mps on`
        cannot be honoured (auto falls back to off with a log line)."""
        flag = f"--mps {self.requested}"
        self._reap_stale()
        if self.requested == "off":
            log.info("MPS off (--mps off): the engines run with the environment as given")
            return
        if not self.cuda:
            if self.requested == "on":
                raise MpsError(f"{flag}: the {self.backend} backend runs no CUDA contexts, so "
                               f"there is nothing for MPS to serve; use --mps auto or off, or "
                               f"--backend cuda")
            log.info("MPS off: the %s backend runs no CUDA contexts (--mps auto)", self.backend)
            return
        self._binary = shutil.which(CONTROL_BINARY, path=self.environ.get("PATH"))
        node = pipe_directory_in_effect(self.environ)
        if self._serving(node):
            self.mode, self.pipe_directory = "node", node
            log.info("MPS: using the node's MPS control daemon on %s (%s); it is not stopped "
                     "at exit", node, flag)
            return
        if self._binary is None:
            if self.requested == "on":
                raise MpsError(f"{flag}: {CONTROL_BINARY} is not on PATH and no MPS control "
                               f"daemon serves {node}; install the NVIDIA driver's MPS "
                               f"utilities (or put them on PATH), start one on {node}, or use "
                               f"--mps auto or off")
            log.info("MPS off: %s is not on PATH and no MPS control daemon serves %s "
                     "(--mps auto)", CONTROL_BINARY, node)
            return
        try:
            self._start_private()
        except MpsError as e:
            if self.requested == "on":
                raise
            # auto: serving works without MPS, only slower; say so loudly and go on.
            log.warning("MPS off: %s (--mps auto; set --mps off to silence this)", e)

    def _serving(self, pipe_directory: str) -> bool:
        """A control daemon serves `pipe_directory`: its pid file names a live process, or (a
        daemon in another pid namespace) its control socket answers `get_server_list`."""
        if control_pid(pipe_directory) is not None:
            return True
        if self._binary is None or not os.path.exists(os.path.join(pipe_directory, CONTROL)):
            return False
        try:
            res = self._command({PIPE_ENV: pipe_directory}, lines=("get_server_list",))
        except MpsError:
            return False
        return res.returncode == 0

    # -- private server ----------------------------------------------------------------------
    def _reap_stale(self) -> None:
        """A private server an earlier daemon on this socket folder left (it died without
        stopping it; this daemon holds the folder's lock, so it is no one else's) is quit and
        its folder removed, whatever mode this daemon runs in."""
        pipe, logs = os.path.join(self.root, "pipe"), os.path.join(self.root, "log")
        stale = control_pid(pipe)
        if stale is not None:
            log.warning("MPS: quitting the private control daemon (pid %d) an earlier daemon "
                        "left in %s", stale, pipe)
            if self._binary is None:
                self._binary = shutil.which(CONTROL_BINARY, path=self.environ.get("PATH"))
            self._quit(stale, {PIPE_ENV: pipe, LOG_ENV: logs})
        shutil.rmtree(self.root, ignore_errors=True)

    def _start_private(self) -> None:
        pipe, logs = os.path.join(self.root, "pipe"), os.path.join(self.root, "log")
        env = {PIPE_ENV: pipe, LOG_ENV: logs}  # (start() removed any earlier folder)
        try:
            for d in (self.root, pipe, logs):
                os.makedirs(d, exist_ok=True)
                os.chmod(d, 0o750)  # clients reach it as the socket folder's group
        except OSError as e:
            raise MpsError(f"--socket-dir: cannot create {self.root} for the private MPS "
                           f"server ({e.strerror or e}); make the folder writable") from None
        # From here on stop() cleans up, whatever fails.
        self.mode, self.pipe_directory, self.log_directory = "private", pipe, logs
        try:
            res = self._command(env, daemon=True)
            if res.returncode != 0:
                raise MpsError(f"{CONTROL_BINARY} -d failed with exit code {res.returncode}"
                               f"{self._last_line(res.stdout)}; see {logs}")
            deadline = time.monotonic() + START_SECONDS
            while control_pid(pipe) is None:
                if time.monotonic() > deadline:
                    raise MpsError(f"{CONTROL_BINARY} -d did not start a control daemon on "
                                   f"{pipe} within {START_SECONDS:.0f} s; see {logs}")
                time.sleep(POLL_SECONDS)
        except BaseException:
            self.stop()
            raise
        log.info("MPS: private control daemon (pid %s) on %s, logs in %s; clients: "
                 "eval \"$(epd env)\"", control_pid(pipe), pipe, logs)

    def _command(self, env: dict[str, str], *, daemon: bool = False,
                 lines: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """Run nvidia-cuda-mps-control: `-d` (daemon=True) or a client sending `lines` on
        stdin. Its output goes to an anonymous file, not a pipe: `-d` leaves a daemon that may
        keep inherited descriptors open, and reading a pipe would wait for it."""
        assert self._binary is not None
        what = "-d" if daemon else " ".join(lines)
        with tempfile.TemporaryFile() as out:
            try:
                res = subprocess.run(
                    [self._binary, "-d"] if daemon else [self._binary],
                    input=None if daemon else "".join(f"{ln}\n" for ln in lines).encode(),
                    stdin=subprocess.DEVNULL if daemon else None, stdout=out,
                    stderr=subprocess.STDOUT, env={**self.environ, **env},
                    timeout=COMMAND_SECONDS)
            except subprocess.TimeoutExpired:
                raise MpsError(f"{CONTROL_BINARY} {what} did not answer within "
                               f"{COMMAND_SECONDS:.0f} s") from None
            except OSError as e:
                raise MpsError(f"cannot run {self._binary} ({e.strerror or e})") from None
            out.seek(0)
            res.stdout = out.read().decode(errors="replace")
        return res

    @staticmethod
    def _last_line(text: str) -> str:
        lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
        return f" ({lines[-1]})" if lines else ""

    def _quit(self, pid: int, env: dict[str, str]) -> None:
        """`quit` to a control daemon, then wait (bounded) for it to exit; SIGTERM if not."""
        try:
            res = self._command(env, lines=("quit",))
            if res.returncode != 0:
                log.warning("MPS: quit answered exit code %d%s", res.returncode,
                            self._last_line(res.stdout))
        except MpsError as e:
            log.warning("MPS: %s", e)
        deadline = time.monotonic() + STOP_SECONDS
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        if _alive(pid):
            log.warning("MPS: control daemon pid %d did not exit within %.0f s of quit; "
                        "sending SIGTERM", pid, STOP_SECONDS)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + KILL_SECONDS
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)

    def stop(self) -> None:
        """Quit a private server (after the engines have stopped) and remove its folders.
        Nothing for "off" and "node" (a node's server is never stopped). Idempotent."""
        if self.mode != "private":
            return
        try:
            pid = control_pid(self.pipe_directory)
            if pid is not None and self._binary is not None:
                self._quit(pid, {PIPE_ENV: self.pipe_directory, LOG_ENV: self.log_directory})
                log.info("MPS: private control daemon stopped")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            self.mode = "off"

    # -- what engines and clients see --------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment for the engine processes: the pipe folder of the server in use (set
        explicitly in node mode too) and ENGINE_ENV; when off, CUDA_MPS_* stay as given."""
        if self.mode == "private":
            return {PIPE_ENV: self.pipe_directory, LOG_ENV: self.log_directory,
                    ENGINE_ENV: self.pipe_directory}
        if self.mode == "node":
            return {PIPE_ENV: self.pipe_directory, ENGINE_ENV: self.pipe_directory}
        return {ENGINE_ENV: ""}
