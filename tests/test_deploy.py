"""Static checks of the deployment files under deploy/ (no daemon, no cluster needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from epd.server import config as config_mod
from epd.server import mps as mps_mod
from epd.server import startup
from epd.server import supervisor as supervisor_mod
from epd.server.config import Config

yaml = pytest.importorskip("yaml")

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
YAML_FILES = sorted(DEPLOY.rglob("*.yaml"))
JSON_FILES = sorted(DEPLOY.rglob("*.json"))
ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
DASHBOARD = DEPLOY / "grafana" / "epd-dashboard.json"
UNIT = DEPLOY / "systemd" / "epd.service"
CLUSTER_DROPIN = DEPLOY / "systemd" / "epd-cluster.conf"
ENV_FILE = DEPLOY / "systemd" / "epd.env"
README = DEPLOY / "README.md"
K8S = DEPLOY / "kubernetes"
SCRAPE = DEPLOY / "prometheus" / "scrape.yaml"

def _exported_metrics() -> dict[str, str]:
    """Every metric family the daemon exports (name as scraped -> type), from the collectors
    server/metrics.py defines (not a list kept by hand: a new metric is checked at once).
    Histograms also expose _bucket/_count/_sum; a counter's samples end in _total."""
    from prometheus_client.metrics import MetricWrapperBase

    from epd.server import metrics as m
    out = {}
    for v in vars(m).values():
        if isinstance(v, MetricWrapperBase):
            out[v._name + ("_total" if v._type == "counter" else "")] = v._type
    return out


METRICS = _exported_metrics()
# Series Prometheus itself attaches to every target.
PROMETHEUS_BUILTINS = {"up"}
# Flags of `epd serve`; each one is also settable as EPD_<FLAG_UPPER_SNAKE>.
SERVE_FLAGS = {
    "backend",
    "engines",
    "socket-dir",
    "metrics-host",
    "metrics-port",
    "config",
    "log-level",
    "timeout-seconds",
}
EPD_ENV_VARS = {"EPD_" + f.upper().replace("-", "_") for f in SERVE_FLAGS} | {
    "EPD_" + f.name.upper() for f in dataclasses.fields(Config)}
NVSHMEM_ENV = {
    "NVSHMEM_DISABLE_NVLS": "1",
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
}

PROMQL_WORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def known_series() -> set[str]:
    names = set(PROMETHEUS_BUILTINS)
    for name, kind in METRICS.items():
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names referenced in a PromQL expression (good enough for these files)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # string literals
    s = re.sub(r"\{[^}]*\}", "", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range and subquery selectors
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(\s*\()?", s):
        if m.group(2) or m.group(1).lower() in PROMQL_WORDS:
            continue  # a function call or a keyword
        names.add(m.group(1))
    return names


def load_yaml_docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path}: key outside a section: {line}"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not key=value: {line}"
        current.append((key.strip(), value.strip()))
    return sections


WORKLOAD_KINDS = {"DaemonSet", "StatefulSet", "Deployment", "ReplicaSet", "Job", "Pod"}


def pod_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def pod_labels(doc: dict) -> dict:
    meta = doc["metadata"] if doc["kind"] == "Pod" else doc["spec"]["template"]["metadata"]
    return meta.get("labels", {})


def pod_templates() -> list[tuple[Path, dict]]:
    """Every workload of every manifest under deploy/kubernetes."""
    return [(path, doc) for path in sorted(K8S.rglob("*.yaml"))
            for doc in load_yaml_docs(path) if doc.get("kind") in WORKLOAD_KINDS]


def kustomizations() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def kustomization_docs(folder: Path) -> list[dict]:
    kust = yaml.safe_load((folder / "kustomization.yaml").read_text())
    return [d for res in kust["resources"] for d in load_yaml_docs(folder / res)]


def relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus' relabelling (replace, keep, drop; anchored regexes) of one target's labels,
    for configs in either spelling (scrape config snake_case, ServiceMonitor camelCase);
    None: the target is dropped."""
    def get(c: dict, key: str, default=None):
        camel = re.sub(r"_(\w)", lambda m: m.group(1).upper(), key)
        return c.get(key, c.get(camel, default))

    labels = dict(labels)
    for c in configs:
        value = get(c, "separator", ";").join(
            labels.get(n, "") for n in get(c, "source_labels", []))
        m = re.fullmatch(str(get(c, "regex", "(.*)")), value)
        action = get(c, "action", "replace").lower()
        if (action == "keep" and not m) or (action == "drop" and m):
            return None
        if action == "replace" and m:
            repl = get(c, "replacement", "$1")
            labels[get(c, "target_label")] = m.expand(
                re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", repl))
    return labels


def pod_targets(doc: dict) -> list[dict[str, str]]:
    """The discovery labels Prometheus' role "pod" gives each metrics port of a workload's pod."""
    base = {"__meta_kubernetes_namespace": doc["metadata"]["namespace"],
            "__meta_kubernetes_pod_node_name": "gpu-a"}
    for k, v in pod_labels(doc).items():
        base["__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9_]", "_", k)] = v
    return [{**base, "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
             "job": "epd-k8s"}
            for c in pod_spec(doc)["containers"] for port in c.get("ports", [])
            if port.get("name") == "metrics"]


def servicemonitor_jobs(doc: dict, docs: list[dict]) -> list[str]:
    """The job label of each ServiceMonitor endpoint among `docs` that scrapes the workload
    `doc`'s metrics port through a Service (the Operator: jobLabel's value on the Service, else
    the Service's name, then the endpoint's relabelings)."""
    labels, ns = pod_labels(doc), doc["metadata"]["namespace"]
    ports = {p["name"]: p["containerPort"] for c in pod_spec(doc)["containers"]
             for p in c.get("ports", []) if "name" in p}
    jobs = []
    for svc in docs:
        if svc["kind"] != "Service" or svc["metadata"]["namespace"] != ns:
            continue
        if not svc["spec"].get("selector") or not svc["spec"]["selector"].items() <= labels.items():
            continue
        svc_ports = [p["name"] for p in svc["spec"]["ports"]
                     if p.get("targetPort") in ("metrics", ports.get("metrics"))]
        for sm in docs:
            if sm["kind"] != "ServiceMonitor":
                continue
            spec = sm["spec"]
            if ns not in spec.get("namespaceSelector", {}).get("matchNames",
                                                                [sm["metadata"]["namespace"]]):
                continue
            if not spec["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items():
                continue
            job = svc["metadata"]["labels"].get(spec.get("jobLabel", ""), svc["metadata"]["name"])
            for ep in spec["endpoints"]:
                if ep.get("port") in svc_ports:
                    out = relabel({"job": job, "__meta_kubernetes_pod_node_name": "gpu-a"},
                                  ep.get("relabelings", []))
                    jobs.append(out["job"] if out else None)
    return jobs


def daemonset() -> dict:
    docs = load_yaml_docs(K8S / "daemonset.yaml")
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return ds


# ---------------------------------------------------------------- syntax


def test_deploy_tree_has_expected_files():
    for rel in [
        "README.md",
        "systemd/epd.service",
        "systemd/epd.env",
        "systemd/epd-cluster.conf",
        "kubernetes/daemonset.yaml",
        "kubernetes/service.yaml",
        "kubernetes/servicemonitor.yaml",
        "kubernetes/kustomization.yaml",
        "kubernetes/multinode/kustomization.yaml",
        "kubernetes/multinode/statefulset.yaml",
        "kubernetes/multinode/service.yaml",
        "kubernetes/multinode/servicemonitor.yaml",
        "prometheus/scrape.yaml",
        "prometheus/alerts.yaml",
        "grafana/epd-dashboard.json",
    ]:
        assert (DEPLOY / rel).is_file(), rel


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_parses(path):
    assert load_yaml_docs(path), f"{path} is empty"


@pytest.mark.parametrize("path", JSON_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_json_parses(path):
    json.loads(path.read_text())


def test_metric_name_parser():
    expr = (
        "histogram_quantile(0.99, sum by (group, le) (rate(epd_dispatch_seconds_bucket"
        '{instance=~"$instance"}[$__rate_interval]))) > 0.005 and on (group) up == 0'
    )
    assert metric_names(expr) == {"epd_dispatch_seconds_bucket", "up"}


# ---------------------------------------------------------------- Prometheus


def alert_rules() -> list[dict]:
    doc = yaml.safe_load(ALERTS.read_text())
    assert set(doc) == {"groups"}
    rules = []
    for group in doc["groups"]:
        assert group["name"] and group["rules"]
        rules += group["rules"]
    return rules


def test_alert_rules_structure():
    rules = alert_rules()
    seen = set()
    for rule in rules:
        assert "record" not in rule
        name = rule["alert"]
        assert name not in seen, f"duplicate alert {name}"
        seen.add(name)
        assert isinstance(rule["expr"], str) and rule["expr"].strip(), name
        assert re.fullmatch(r"(\d+[smhdwy])+", str(rule["for"])), name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"].strip(), name
    wanted = {
        "EngineDown",
        "EngineRestarting",
        "EngineCannotStart",
        "HighCollectiveTimeouts",
        "GroupAborts",
        "ExpertLoadImbalance",
        "DispatchP99High",
    }
    assert wanted <= {n.removeprefix("Epd") for n in seen}


def test_alert_thresholds():
    rules = {r["alert"]: r for r in alert_rules()}
    imbalance = rules["EpdExpertLoadImbalance"]
    assert "epd_expert_load_imbalance_ratio" in imbalance["expr"]
    assert re.search(r">\s*4\b", imbalance["expr"]) and imbalance["for"] == "10m"
    p99 = rules["EpdDispatchP99High"]["expr"]
    assert "histogram_quantile(0.99" in p99 and "epd_dispatch_seconds_bucket" in p99


def test_readme_names_every_alert():
    readme = README.read_text()
    missing = [r["alert"] for r in alert_rules()
               if not re.search(rf"\b{re.escape(r['alert'])}\b", readme)]
    assert not missing, f"deploy/README.md does not name {missing}"


def test_alert_metrics_exist():
    known = known_series()
    for rule in alert_rules():
        names = metric_names(rule["expr"])
        assert names, rule["alert"]
        assert names <= known, f"{rule['alert']}: unknown metrics {names - known}"


def test_scrape_config():
    doc = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yaml").read_text())
    assert doc["rule_files"] == ["alerts.yaml"]
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert jobs["epd"]["static_configs"][0]["targets"] == ["127.0.0.1:9464"]


# `make test` unpacks promtool into the venv beside the interpreter.
PROMTOOL = (shutil.which("promtool")
            or shutil.which("promtool", path=os.path.dirname(sys.executable)))


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_promtool_check_rules():
    subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], check=True)


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed")
def test_promtool_check_config():
    res = subprocess.run(
        [PROMTOOL, "check", "config", str(DEPLOY / "prometheus" / "scrape.yaml")],
        capture_output=True,
        text=True,
    )
    if res.returncode and "kubernetes_sd_configs not found" in res.stdout + res.stderr:
        # Debian's promtool is built without Kubernetes discovery: check every other job (and
        # the rule file) from a copy without the Kubernetes job, which test_scrape_config and
        # the ServiceMonitor test cover.
        doc = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yaml").read_text())
        doc["scrape_configs"] = [j for j in doc["scrape_configs"]
                                 if "kubernetes_sd_configs" not in j]
        doc["rule_files"] = [str(ALERTS)]
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "scrape.yaml"
            path.write_text(yaml.safe_dump(doc))
            res = subprocess.run([PROMTOOL, "check", "config", str(path)],
                                 capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------- Grafana


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(panels: list[dict]) -> list[dict]:
    out = []
    for p in panels:
        out.append(p)
        out += all_panels(p.get("panels", []))
    return out


def test_dashboard_structure():
    dash = dashboard()
    assert dash["schemaVersion"] == 39
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = all_panels(dash["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in panels:
        assert {"h", "w", "x", "y"} <= set(p["gridPos"]), p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]


def test_dashboard_metrics_exist():
    known = known_series()
    dash = dashboard()
    used = set()
    for p in all_panels(dash["panels"]):
        for t in p.get("targets", []):
            names = metric_names(t["expr"])
            assert names, p["title"]
            assert names <= known, f"{p['title']}: unknown metrics {names - known}"
            used |= names
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", v["definition"])
            assert m and m.group(1) in known, v["name"]
    # Every exported family appears on the dashboard (build_info via the $instance variable).
    families = {re.sub(r"_(bucket|count|sum)$", "", n) for n in used} | {"epd_build_info"}
    assert set(METRICS) <= families, f"not shown: {set(METRICS) - families}"


# ---------------------------------------------------------------- systemd

# The two gRPC servers' stop(grace=0.5) in Supervisor._shutdown (no constant to import).
SERVERS_STOP_SECONDS = 1.0
# What a stop timeout must leave beyond the worst case computed below.
STOP_MARGIN_SECONDS = 15.0


def stop_bound(env: dict[str, str]) -> float:
    """The longest a graceful stop (SIGTERM to the supervisor) can take, from the code's own
    constants, with the drain that `env` sets (else Config's default): Supervisor.stop_engines
    (the drain, then SIGKILL, then the wait for the killed), the cancellations of the lease
    with node 0, the servers' grace, the loop's close (tasks that ignore their cancellation),
    stop_leftover_engines for an engine that still had not exited (SIGTERM, SIGKILL, wait),
    then Mps.stop's quit of a private server (the command, the wait, SIGTERM and its wait), and
    the process's exit deadline (threads still running at exit)."""
    drain = float(env.get("EPD_DRAIN_SECONDS", Config.drain_seconds))
    sup, mps = supervisor_mod, mps_mod
    return (drain + sup.DRAIN_EXTRA_SECONDS + sup.KILLED_EXIT_SECONDS
            + sup.CANCEL_TRIES * 1.0 + SERVERS_STOP_SECONDS + startup.LOOP_CLOSE_SECONDS
            + sup.LEFTOVER_ENGINE_SECONDS + sup.KILLED_EXIT_SECONDS
            + mps.COMMAND_SECONDS + mps.STOP_SECONDS + mps.KILL_SECONDS
            + startup.EXIT_SECONDS + STOP_MARGIN_SECONDS)


def unit_env(path: Path) -> dict[str, str]:
    env = {}
    for k, v in parse_unit(path).get("Service", []):
        if k == "Environment":
            for item in v.split():
                name, _, value = item.strip('"').partition("=")
                env[name] = value
    return env


def test_stop_timeouts_cover_the_worst_case_drain():
    """systemd's TimeoutStopSec and every pod's terminationGracePeriodSeconds outlast the
    daemon's worst-case stop (computed from server/supervisor.py, server/mps.py and
    server/config.py), and the comments and README quote that figure."""
    keys = dict(parse_unit(UNIT)["Service"])
    assert int(keys["TimeoutStopSec"]) >= stop_bound(unit_env(UNIT)), keys["TimeoutStopSec"]
    templates = pod_templates()
    assert {path.name for path, _ in templates} >= {"daemonset.yaml", "statefulset.yaml"}
    for path, doc in templates:
        pod = pod_spec(doc)
        env = {e["name"]: e.get("value", "") for c in pod["containers"] for e in c.get("env", [])}
        grace = pod.get("terminationGracePeriodSeconds", 30)
        assert grace >= stop_bound(env), f"{path.name}: {grace} < {stop_bound(env)}"
    worst = stop_bound({}) - STOP_MARGIN_SECONDS
    for path in [UNIT, README, K8S / "daemonset.yaml", K8S / "multinode" / "statefulset.yaml"]:
        assert f"about {worst:.0f} s" in " ".join(path.read_text().split()), path.name


def test_systemd_unit():
    unit = parse_unit(UNIT)
    service = unit["Service"]
    keys = dict(service)
    env = {}
    for k, v in service:
        if k == "Environment":
            for item in v.split():
                name, _, value = item.strip('"').partition("=")
                env[name] = value
    # The unit never multicasts, and leaves the one-node transport settings to the daemon
    # (CudaPlanner.engine_env): set here, they would break a cluster's world.
    assert env.get("NVSHMEM_DISABLE_NVLS") == "1"
    assert "NVSHMEM_REMOTE_TRANSPORT" not in env and "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME" not in env
    assert keys["Type"] == "simple"
    assert keys["User"] == "epd" and keys["Group"] == "epd"
    assert keys["RuntimeDirectory"] == "epd" and keys["RuntimeDirectoryMode"] == "0750"
    assert keys["Restart"] == "on-failure"
    assert keys["KillSignal"] == "SIGTERM"
    assert int(keys["TimeoutStopSec"]) >= stop_bound(env)  # (test_stop_timeouts_...)
    assert keys["ExecStart"].split()[1:] == ["serve"]
    assert env["EPD_SOCKET_DIR"] == "/run/" + keys["RuntimeDirectory"]
    assert keys.get("PrivateDevices", "no") == "no"  # the GPUs must stay visible
    assert unit["Install"] == [("WantedBy", "multi-user.target")]


def env_file_settings() -> dict[str, str]:
    """epd.env's setting lines (#EPD_NAME=value, commented out) -> value; prose lines ("# ...")
    are not settings."""
    settings: dict[str, str] = {}
    for raw in ENV_FILE.read_text().splitlines():
        m = re.fullmatch(r"(#?)(EPD_[A-Z0-9_]+)=(.*)", raw.strip())
        if m:
            assert m.group(1), f"epd.env sets {m.group(2)}: every line is commented out"
            assert m.group(2) not in settings, f"epd.env lists {m.group(2)} twice"
            settings[m.group(2)] = m.group(3)
    return settings


def test_env_file_lists_every_setting_with_its_default():
    """epd.env names every setting of server/config.py's Config (and EPD_CONFIG), each with
    the value the daemon takes by default, read back the way the daemon reads it."""
    settings = env_file_settings()
    assert set(settings) <= EPD_ENV_VARS, set(settings) - EPD_ENV_VARS
    wanted = {"EPD_" + f.name.upper() for f in dataclasses.fields(Config)} | {"EPD_CONFIG"}
    assert set(settings) == wanted, f"missing {sorted(wanted - set(settings))}"
    assert settings["EPD_CONFIG"] == ""  # (no file by default)
    default = Config()
    for f in dataclasses.fields(Config):
        name = "EPD_" + f.name.upper()
        loaded = config_mod.load(env={name: settings[name]})
        assert getattr(loaded, f.name) == getattr(default, f.name), (
            f"epd.env: {name}={settings[name]} but the default is {getattr(default, f.name)!r}")


def test_cluster_dropin():
    """The cluster drop-in starts after the network is up (node 0 binds its cluster address
    and exits 2 otherwise) and uses mutual TLS, its files as systemd credentials."""
    unit = parse_unit(CLUSTER_DROPIN)
    after = [w for k, v in unit["Unit"] if k == "After" for w in v.split()]
    wants = [w for k, v in unit["Unit"] if k == "Wants" for w in v.split()]
    assert "network-online.target" in after and "network-online.target" in wants
    env = unit_env(CLUSTER_DROPIN)
    assert int(env["EPD_NUM_NODES"]) > 1
    assert "EPD_CLUSTER_PLAINTEXT" not in env
    creds = {v.partition(":")[0] for k, v in unit["Service"] if k == "LoadCredential"}
    for name in ["EPD_CLUSTER_TOKEN_FILE", "EPD_CLUSTER_TLS_CERT", "EPD_CLUSTER_TLS_KEY",
                 "EPD_CLUSTER_TLS_CA"]:
        assert env[name].startswith("%d/") and env[name][3:] in creds, name


# ---------------------------------------------------------------- Kubernetes


def test_kustomization_resources_exist():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["namespace"] == "epd"
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res
    assert {"daemonset.yaml", "service.yaml", "servicemonitor.yaml"} <= set(kust["resources"])


def test_all_k8s_objects_in_namespace():
    for path in K8S.glob("*.yaml"):
        if path.name == "kustomization.yaml":
            continue
        for doc in load_yaml_docs(path):
            if doc["kind"] != "Namespace":
                assert doc["metadata"]["namespace"] == "epd", f"{path.name}: {doc['kind']}"


def test_daemonset():
    ds = daemonset()
    pod = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pod["hostIPC"] is True
    assert pod.get("hostNetwork", False) is False
    assert pod["nodeSelector"] and pod["tolerations"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert not c["securityContext"].get("privileged", False)

    env = {e["name"]: e for e in c["env"]}
    for name, value in NVSHMEM_ENV.items():
        assert env[name]["value"] == value, name
    assert {n for n in env if n.startswith("EPD_")} <= EPD_ENV_VARS
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == int(env["EPD_METRICS_PORT"]["value"])
    # Liveness through node.sock (`epd health`: no HTTP client can crowd it out), readiness
    # through /readyz (its reason text).
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["exec"]["command"][:2] == ["epd", "health"], probe
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}

    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths["socket-dir"] == "/run/epd" == env["EPD_SOCKET_DIR"]["value"]
    assert host_paths["dev-shm"] == "/dev/shm"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["socket-dir"] == "/run/epd" and mounts["dev-shm"] == "/dev/shm"


def test_service_and_servicemonitor_match_daemonset():
    ds = daemonset()
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    (svc,) = load_yaml_docs(K8S / "service.yaml")
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["name"] == "metrics" and port["targetPort"] == "metrics"
    (sm,) = load_yaml_docs(K8S / "servicemonitor.yaml")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1" and sm["kind"] == "ServiceMonitor"
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]


def test_multinode_statefulset_takes_rank_address_and_token():
    """deploy/kubernetes/multinode: the node rank is the pod ordinal, node 0's Cluster address
    names pod 0 through the headless Service on its cluster port, the token is a file from the
    Secret readable by the daemon's group, as many replicas as nodes, one per machine."""
    multi = K8S / "multinode"
    kust = yaml.safe_load((multi / "kustomization.yaml").read_text())
    assert kust["namespace"] == "epd"
    for res in kust["resources"]:
        assert (multi / res).is_file(), res
    docs = [d for res in kust["resources"] for d in load_yaml_docs(multi / res)]
    assert all(d["metadata"]["namespace"] == "epd" for d in docs)
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    pod = sts["spec"]["template"]["spec"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert {n for n in env if n.startswith("EPD_")} <= EPD_ENV_VARS
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert "EPD_NODE_RANK=${POD_NAME##*-}" in c["command"][-1] and "epd serve" in c["command"][-1]
    assert int(env["EPD_NUM_NODES"]["value"]) == sts["spec"]["replicas"] > 1
    assert env["EPD_CUDA_CLUSTER"]["value"] == "1" and env["EPD_BACKEND"]["value"] == "cuda"
    host, port = env["EPD_CLUSTER_ADDRESS"]["value"].rsplit(":", 1)
    assert host.split(".")[:3] == [f"{sts['metadata']['name']}-0", svc["metadata"]["name"],
                                   "epd"]
    svc_ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert int(port) == svc_ports["cluster"] == ports["cluster"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    token = env["EPD_CLUSTER_TOKEN_FILE"]["value"]
    (vol,) = [n for n in secrets if token.startswith(mounts[n] + "/")]
    assert secrets[vol]["secretName"] == "epd-cluster-token"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    assert secrets[vol]["defaultMode"] & 0o040 and not secrets[vol]["defaultMode"] & 0o007
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["topologyKey"] == "kubernetes.io/hostname"
    assert env["NVSHMEM_DISABLE_NVLS"]["value"] == "1"
    assert "NVSHMEM_REMOTE_TRANSPORT" not in env  # (not "none": the nodes talk over the fabric)
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_relabel_simulation():
    cfg = [{"source_labels": ["a"], "regex": "x|y", "action": "keep"},
           {"sourceLabels": ["a"], "targetLabel": "b", "replacement": "<$1>"},
           {"target_label": "job", "replacement": "epd"}]
    assert relabel({"a": "x", "job": "j"}, cfg) == {"a": "x", "b": "<x>", "job": "epd"}
    assert relabel({"a": "xy"}, cfg) is None  # (anchored)


@pytest.mark.parametrize("folder", kustomizations(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_workload_is_scraped_as_job_epd(folder):
    """Each workload of a kustomization is scraped with job="epd" (what the alert rules and
    the dashboard select) both under the Operator (a ServiceMonitor of the same kustomization,
    through a Service) and without it (scrape.yaml's Kubernetes job)."""
    docs = kustomization_docs(folder)
    workloads = [d for d in docs if d["kind"] in WORKLOAD_KINDS]
    assert workloads
    jobs = {j["job_name"]: j for j in yaml.safe_load(SCRAPE.read_text())["scrape_configs"]}
    (k8s_job,) = [j for j in jobs.values() if "kubernetes_sd_configs" in j]
    (sd,) = k8s_job["kubernetes_sd_configs"]
    for doc in workloads:
        name = f"{folder.name}/{doc['kind']}/{doc['metadata']['name']}"
        sm_jobs = servicemonitor_jobs(doc, docs)
        assert sm_jobs and set(sm_jobs) == {"epd"}, f"{name}: ServiceMonitor jobs {sm_jobs}"
        targets = pod_targets(doc)
        assert targets, f"{name}: no container port named metrics"
        assert sd["role"] == "pod" and doc["metadata"]["namespace"] in sd["namespaces"]["names"]
        for t in targets:
            out = relabel(t, k8s_job["relabel_configs"])
            assert out is not None, f"{name}: dropped by scrape job {k8s_job['job_name']}"
            assert out["job"] == "epd", name


def test_no_plaintext_cluster_port_on_host_network():
    """A hostNetwork pod's Cluster port is on the node's address, where no NetworkPolicy
    applies: no shipped manifest opts into plaintext there, and every cluster-mode workload
    takes mutual TLS from a mounted Secret."""
    for path, doc in pod_templates():
        pod = pod_spec(doc)
        for c in pod.get("initContainers", []) + pod["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            argv = " ".join(c.get("command", []) + c.get("args", []))
            if pod.get("hostNetwork"):
                assert "EPD_CLUSTER_PLAINTEXT" not in env and "--cluster-plaintext" not in argv, (
                    f"{path.name}: plaintext Cluster port with hostNetwork")
            if int(env.get("EPD_NUM_NODES", {}).get("value", 1)) <= 1:
                continue
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            secrets = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
            for name in ["EPD_CLUSTER_TLS_CERT", "EPD_CLUSTER_TLS_KEY", "EPD_CLUSTER_TLS_CA"]:
                folder, _, _ = env[name]["value"].rpartition("/")
                assert mounts.get(folder) in secrets, f"{path.name}: {name} not from a Secret"
                secret = secrets[mounts[folder]]
                assert not secret.get("defaultMode", 0o644) & 0o007, f"{path.name}: {name}"


KUBECTL = shutil.which("kubectl")


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
def test_kustomize_builds():
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S)], capture_output=True, text=True, check=True
    ).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
    assert kinds == ["DaemonSet", "Namespace", "Service", "ServiceAccount", "ServiceMonitor"]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed")
def test_multinode_kustomize_builds():
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "multinode")], capture_output=True, text=True,
        check=True).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
    assert kinds == ["Service", "ServiceAccount", "ServiceMonitor", "StatefulSet"]
