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
])
def test_bad_values_name_the_setting(tmp_path, argv, env, toml, setting):
    if toml is not None:
        path = tmp_path / "bad.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    with pytest.raises(ValueError, match=setting):
        load(argv, env)


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
