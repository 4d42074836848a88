"""Configuration precedence (defaults < TOML < EPD_* env < flags) and the command line."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from epd.server import config
from epd.server.cli import build_parser


def load(argv: list[str] | None = None, env: dict[str, str] | None = None):
    ns = build_parser().parse_args(["serve", *(argv or [])])
    return config.load(ns, env or {})


def test_defaults():
    cfg = load()
    assert cfg == config.Config()
    assert cfg.timeout_seconds == 10.0 and cfg.socket_dir == "/run/epd"
    assert cfg.per_expert_metrics is False


def test_precedence(tmp_path: Path):
    toml = tmp_path / "epd.toml"
    toml.write_text('engines = 3\ntimeout_seconds = 4.5\nsocket_dir = "/from/toml"\n'
                    'max_handles_per_session = 7\nper_expert_metrics = true\n')
    cfg = load(["--config", str(toml)])
    assert (cfg.engines, cfg.timeout_seconds, cfg.socket_dir, cfg.max_handles_per_session) == \
        (3, 4.5, "/from/toml", 7)
    assert cfg.per_expert_metrics is True
    env = {"EPD_ENGINES": "5", "EPD_SOCKET_DIR": "/from/env", "EPD_PER_EXPERT_METRICS": "0"}
    cfg = load(["--config", str(toml)], env)
    assert (cfg.engines, cfg.timeout_seconds, cfg.socket_dir, cfg.max_handles_per_session) == \
        (5, 4.5, "/from/env", 7)
    assert cfg.per_expert_metrics is False
    cfg = load(["--config", str(toml), "--engines", "6", "--per-expert-metrics"], env)
    assert (cfg.engines, cfg.socket_dir, cfg.max_handles_per_session) == (6, "/from/env", 7)
    assert cfg.per_expert_metrics is True


def test_toml_epd_table_and_env_config(tmp_path: Path):
    toml = tmp_path / "epd.toml"
    toml.write_text('[epd]\nbackend = "cpu"\nmetrics_port = 0\n')
    cfg = config.load(None, {"EPD_CONFIG": str(toml), "EPD_DRAIN_SECONDS": "2"})
    assert (cfg.backend, cfg.metrics_port, cfg.drain_seconds) == ("cpu", 0, 2.0)


@pytest.mark.parametrize("argv,env,toml,setting", [
    (["--engines", "two"], {}, None, "engines"),
    ([], {"EPD_TIMEOUT_SECONDS": "soon"}, None, "timeout_seconds"),
    ([], {"EPD_PER_EXPERT_METRICS": "maybe"}, None, "per_expert_metrics"),
    (["--backend", "gpu"], {}, None, "backend"),
    (["--log-level", "loud"], {}, None, "log_level"),
    ([], {}, "timeout_seconds = 0\n", "timeout_seconds"),
    ([], {}, "engines = -1\n", "engines"),
    ([], {}, "no_such_setting = 1\n", "no_such_setting"),
    ([], {}, 'metrics_port = "x"\n', "metrics_port"),
    (["--cuda-max-connections", "64"], {}, None, "cuda_max_connections"),
    ([], {"EPD_CUDA_MAX_CONNECTIONS": "0"}, None, "cuda_max_connections"),
    (["--slow-operation-seconds", "-1"], {}, None, "slow_operation_seconds"),
    # NaN passed every `<= 0` check: no default deadline, engines never restarted
    ([], {"EPD_TIMEOUT_SECONDS": "nan"}, None, "timeout_seconds must be a finite"),
    ([], {"EPD_RESTART_BACKOFF_SECONDS": "nan"}, None, "restart_backoff_seconds"),
    ([], {"EPD_CLUSTER_HEARTBEAT_SECONDS": "inf"}, None, "cluster_heartbeat_seconds"),
    ([], {"EPD_MAX_TIMEOUT_SECONDS": "0"}, None, "max_timeout_seconds"),
    (["--metrics-port", "70000"], {}, None, "metrics_port"),
    ([], {"EPD_DRAIN_SECONDS": "-1"}, None, "drain_seconds"),
    # (a uid_t is unsigned: -1 matched no client, and now names no namespace either)
    (["--allow-uids", "1001,-1"], {}, None, "allow_uids: ids lie in"),
    ([], {"EPD_ALLOW_GIDS": "4294967295"}, None, "allow_gids: ids lie in"),
])
def test_bad_values_name_the_setting(tmp_path, argv, env, toml, setting):
    if toml is not None:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    with pytest.raises(ValueError, match=setting):
        load(argv, env)


# (setting, a value outside its range, the bound just inside it): the engines' limits, which
# load() once took unchecked (a negative session cap, a ring the engine refuses to make).
_RING = ("fast_path_slots", "fast_path_slot_bytes")
OUT_OF_RANGE = [
    ("max_sessions", "0", "1"),
    ("max_sessions", "-5", "1"),
    ("fast_path_slots", "0", "1"),
    ("fast_path_slots", "1025", "1024"),
    ("fast_path_slot_bytes", "4095", "4096"),
    ("fast_path_slot_bytes", "1048577", "1048576"),
    ("fast_path_slot_bytes", "-1", "4096"),
    ("num_sms", "-1", "0"),
    ("num_sms", "1025", "1024"),
    ("ll_num_sms", "-1", "0"),
    ("nvshmem_heap_bytes", "0", "1"),
    ("nvshmem_heap_bytes", "-4294967296", "1"),
    ("max_group_label_values", "-1", "0"),
    ("engines", "-1", "0"),
    ("engines", "257", "256"),
    ("ll_chain_members", "-1", "0"),
    ("max_regions_per_session", "0", "1"),
    ("max_region_bytes_per_session", "-1", "1"),
    ("max_groups_per_session", "0", "1"),
    ("max_stream_ops_per_session", "-1", "0"),
    ("max_handles_per_session", "0", "1"),
    ("fast_path_spin_us", "-1", "0"),
    ("stream_op_poll_us", "-1", "0"),
    ("stream_op_idle_poll_us", "-1", "0"),
    ("stream_op_idle_poll_us", "100001", "100000"),
    ("ll_chain_poll_us", "-1", "0"),
    ("ll_chain_poll_us", "2001", "2000"),
    # (an adversarial round: beyond these an engine restarted for ever instead of a one-line
    # error: gRPC's int32 keepalive milliseconds, CPython's GIL wait)
    ("session_keepalive_seconds", "86401", "86400"),
    ("gil_switch_us", "1000001", "1000000"),
]


@pytest.mark.parametrize(("name", "bad", "edge"), OUT_OF_RANGE,
                         ids=[f"{n}={b}" for n, b, _ in OUT_OF_RANGE])
def test_limits_out_of_range_are_one_line_errors_naming_the_setting(name, bad, edge):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=rf"^{name} must ") as err:
        load([flag, bad])
    assert "\n" not in str(err.value) and f"got {bad}" in str(err.value)
    with pytest.raises(ValueError, match=rf"^{name} must "):  # (the env names it alike)
        load([], {f"EPD_{name.upper()}": bad})
    assert getattr(load([flag, edge]), name) == int(edge)  # the bound itself is accepted


def test_ring_limits_are_the_engines():
    """The fast-path defaults lie in the ring's limits, which the help texts quote."""
    from epd.proto import ring

    fields = {f.name: f for f in dataclasses.fields(config.Config)}
    assert f"1-{ring.MAX_SLOTS}" in fields["fast_path_slots"].metadata["help"]
    assert f"{ring.MIN_SLOT_BYTES}-{ring.MAX_SLOT_BYTES}" in \
        fields["fast_path_slot_bytes"].metadata["help"]
    cfg = load()
    assert 1 <= cfg.fast_path_slots <= ring.MAX_SLOTS
    assert ring.MIN_SLOT_BYTES <= cfg.fast_path_slot_bytes <= ring.MAX_SLOT_BYTES
    with pytest.raises(ValueError, match="fast_path_slots"):
        load(["--fast-path-slots", str(ring.MAX_SLOTS + 1)])


def test_a_default_deadline_above_the_longest_is_an_error():
    """timeout_seconds above max_timeout_seconds was clamped to it without a word."""
    with pytest.raises(ValueError, match=r"^timeout_seconds \(700\) must be at most "
                                         r"max_timeout_seconds \(600\)$"):
        load([], {"EPD_TIMEOUT_SECONDS": "700"})
    with pytest.raises(ValueError, match="max_timeout_seconds"):
        load(["--max-timeout-seconds", "5", "--timeout-seconds", "6"])
    cfg = load(["--max-timeout-seconds", "5", "--timeout-seconds", "5"])
    assert cfg.timeout_seconds == cfg.max_timeout_seconds == 5.0


def test_to_env_roundtrip():
    cfg = load(["--engines", "3", "--per-expert-metrics", "--timeout-seconds", "2.5"])
    assert config.load(None, cfg.to_env()) == cfg


def test_engine_socket_paths():
    cfg = load(["--socket-dir", "/x/y"])
    assert cfg.engine_socket(3) == "/x/y/gpu3.sock" and cfg.node_socket == "/x/y/node.sock"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["demo", "--help"],
                                  ["topology", "--help"]])
def test_cli_help(argv):
    r = _run(sys.executable, "-m", "epd.server.cli", *argv)
    assert r.returncode == 0, r.stderr
    assert "usage: epd" in r.stdout
    if argv[0] == "serve":
        assert "--timeout-seconds" in r.stdout and "EPD_TIMEOUT_SECONDS" in r.stdout


def test_console_script():
    exe = Path(sys.executable).parent / "epd"
    if not exe.exists():
        pytest.skip("no epd console script beside this interpreter")
    r = _run(str(exe), "--version")
    assert r.returncode == 0 and r.stdout.startswith("epd ")


def test_serve_rejects_a_bad_setting():
    r = subprocess.run([sys.executable, "-m", "epd.server.cli", "serve", "--engines", "x"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "EPD_SOCKET_DIR": "/nonexistent/epd"})
    assert r.returncode == 2
    assert "configuration error" in r.stderr and "engines" in r.stderr


def test_topology_without_daemon(tmp_path):
    r = _run(sys.executable, "-m", "epd.server.cli", "topology", "--socket-dir", str(tmp_path))
    assert r.returncode == 1 and "no daemon answers" in r.stderr
    # one line, with what to do (not gRPC's connection wording)
    assert r.stderr.count("\n") == 1 and "(no such socket)" in r.stderr
    assert f"epd serve --socket-dir {tmp_path}" in r.stderr and "last error" not in r.stderr


def test_health_without_daemon_and_with_one(tmp_path):
    """`epd health` (the exec liveness probe): 1 and one line without a daemon; 0 and SERVING
    with one (a CPU daemon here), 1 once it stopped."""
    r = _run(sys.executable, "-m", "epd.server.cli", "health", "--socket-dir", str(tmp_path))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r
    assert "no daemon answers" in r.stderr and "(no such socket)" in r.stderr, r.stderr
    from conftest import TestDaemon
    d = TestDaemon(engines=1)
    try:
        d.wait_ready(60)
        r = _run(sys.executable, "-m", "epd.server.cli", "health", "--socket-dir", d.socket_dir)
        assert r.returncode == 0 and r.stdout.strip() == "SERVING", r
    finally:
        d.stop_and_check()
    r = _run(sys.executable, "-m", "epd.server.cli", "health", "--socket-dir", d.socket_dir)
    assert r.returncode == 1, r


def test_topology_and_env_follow_epd_socket_dir(tmp_path):
    """As the client library does: EPD_SOCKET_DIR names the daemon (was: /run/epd always)."""
    for cmd in ("topology", "env"):
        r = subprocess.run([sys.executable, "-m", "epd.server.cli", cmd], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "EPD_SOCKET_DIR":
                                                       str(tmp_path / "sock")})
        assert r.returncode != 0 and str(tmp_path / "sock") in r.stderr, (cmd, r.stderr)


@pytest.mark.parametrize(("argv", "env", "want"), [
    ([], {}, "auto"),
    (["--ll-chain"], {}, "on"),  # the bare flag of the opt-in days
    (["--no-ll-chain"], {"EPD_LL_CHAIN": "on"}, "off"),  # and its boolean negation
    (["--ll-chain", "auto"], {}, "auto"),
    ([], {"EPD_LL_CHAIN": "1"}, "on"),
    ([], {"EPD_LL_CHAIN": "no"}, "off"),
    (["--ll-chain=off"], {"EPD_LL_CHAIN": "on"}, "off"),  # the flag wins
])
def test_ll_chain_switch(argv, env, want):
    assert load(argv, env).ll_chain == want


def test_no_flag_of_every_switch():
    switches = [f.name for f in dataclasses.fields(config.Config)
                if f.metadata.get("choices") == ("auto", "on", "off")]
    assert {"ll_chain", "class_engines", "mps"} <= set(switches)
    for name in switches:
        flag = name.replace("_", "-")
        assert getattr(load([f"--no-{flag}"], {f"EPD_{name.upper()}": "on"}), name) == "off"
        assert getattr(load([f"--{flag}", "on"]), name) == "on"


def test_ll_chain_refuses_other_words():
    with pytest.raises(ValueError, match="ll_chain"):
        load(["--ll-chain", "maybe"])


@pytest.mark.parametrize(("content", "words"), [
    (None, "cannot read it"),                      # no such file
    (b"engines = [1\n", "not a TOML file"),       # was: "Unclosed array ...", no file named
    (b"\xff\xfe", "not a TOML file"),             # was: a bare codec error
    (b"epd = 1\n", "must be a table"),            # was: TypeError traceback
])
def test_a_bad_config_file_is_one_line_naming_it(tmp_path, content, words):
    path = tmp_path / "epd.toml"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=rf"^--config {path}: .*{words}") as err:
        load(["--config", str(path)])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=rf"^--config {tmp_path}: cannot read it"):
        load(["--config", str(tmp_path)])  # a folder


@pytest.mark.parametrize("toml", ["engines = 2.7\n", "engines = true\n",
                                  "timeout_seconds = true\n", "metrics_port = 9464.5\n"])
def test_toml_numbers_of_the_wrong_type_are_refused(tmp_path, toml):
    """`engines = 2.7` ran 2 engines, `timeout_seconds = true` a 1 s deadline, without a word."""
    path = tmp_path / "epd.toml"
    path.write_text(toml)
    with pytest.raises(ValueError, match=rf"^{toml.split()[0]}: expected "):
        load(["--config", str(path)])


def test_toml_numbers_of_the_right_type_still_load(tmp_path):
    path = tmp_path / "epd.toml"
    path.write_text("engines = 3\ntimeout_seconds = 2\ndrain_seconds = 1.5\n")
    cfg = load(["--config", str(path)])
    assert (cfg.engines, cfg.timeout_seconds, cfg.drain_seconds) == (3, 2.0, 1.5)


@pytest.mark.parametrize(("argv", "words"), [
    (["--num-nodes", "1025"], "num_nodes must be at most 1024"),
    (["--socket-dir", ""], "socket_dir '': must name a folder"),
    (["--shm-dir", "/tmp/a\0b"], "must name a folder (non-empty, no NUL byte)"),
    (["--metrics-host", ""], "metrics_host must be an address"),
    (["--metrics-host", "  "], "metrics_host must be an address"),
])
def test_paths_hosts_and_node_counts_that_cannot_work_are_refused(argv, words):
    """Each was a traceback, a silent bind of every interface, or a node 0 whose topology
    answer passed gRPC's message limit (an adversarial round)."""
    with pytest.raises(ValueError) as err:
        load(argv)
    assert words in str(err.value) and "\n" not in str(err.value), err.value
