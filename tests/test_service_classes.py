"""Service classes (issue 14): the policy (parsing, defaults, what may be asked, by group name
and client uid), its refusals (PERMISSION_DENIED naming the rule, on every rank, nothing
changed), two groups of different classes running at once exact against the reference, the
per-group metrics, GetStats and `epd topology`, the DeepEP facade's keyword, and the SM-budget
and stream-priority rules the CUDA engine applies (device-free parts)."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from daemon_harness import samples, value
from ranklib import Case, case_round, check_case, join

from epd.client import EpdError, Session
from epd.client.buffer import Buffer
from epd.proto.errors import InvalidArgument, PermissionDenied
from epd.proto.v1 import epd_pb2
from epd.server import config
from epd.server import service_classes as sc
from epd.server.cli import build_parser
from epd.server.engine.stream_calls import StreamCalls

UID = os.getuid()
OTHER_UID = UID + 4242  # a uid no test process has
POLICY = (f"svc-decode-*=latency, svc-prefill-*=throughput, svc-open-*@{OTHER_UID}=latency, "
          f"svc-open-*@{UID}=throughput/latency")
DAEMON_EXTRA = ["--service-class-policy", POLICY, "--throughput-num-sms", "8"]


def load(argv: list[str] | None = None, env: dict[str, str] | None = None) -> config.Config:
    return config.load(build_parser().parse_args(["serve", *(argv or [])]), env or {})


# ------------------------------------------------------------------------------------ policy

def test_policy_parses_and_prints_canonically():
    p = sc.parse_policy(" decode-* = latency ,prefill-*=throughput,"
                        " *@1002+1001=throughput / latency ")
    assert [(r.pattern, sorted(r.uids), r.default, r.most, r.index) for r in p.rules] == [
        ("decode-*", [], "latency", "latency", 1),
        ("prefill-*", [], "throughput", "throughput", 2),
        ("*", [1001, 1002], "throughput", "latency", 3)]
    assert p.text == "decode-*=latency, prefill-*=throughput, *@1001+1002=throughput/latency"
    assert sc.parse_policy(p.text) == p
    assert sc.parse_policy("") == sc.parse_policy("  ") == sc.Policy()


@pytest.mark.parametrize("text,words", [
    ("decode-*", "rule 1 'decode-*': expected PATTERN"),
    ("=latency", "rule 1 '=latency': expected PATTERN"),
    ("a=latency,,b=throughput", "rule 2 is empty"),
    ("a=latency,", "rule 2 is empty"),
    ("a=fast", "rule 1 'a=fast': unknown service class 'fast'"),
    ("a=throughput,b=latency/turbo", "rule 2 'b=latency/turbo': unknown service class 'turbo'"),
    ("a=latency/throughput", "the default class latency is more than the most allowed"),
    ("a@x=latency", "uids after '@' must be numbers"),
    ("a@1+=latency", "uids after '@' must be numbers"),
    ("a@-3=latency", "uids must be >= 0"),
    ("@1001=latency", "the group name pattern is empty"),
    ("a@1@2=latency", "may not contain '=' or '@'"),
    ("a=b=latency", "may not contain '=' or '@'"),
])
def test_bad_policies_are_one_line_errors_naming_the_rule(text, words):
    with pytest.raises(ValueError) as ei:
        load(["--service-class-policy", text])
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith("service_class_policy") and words in msg, msg


def test_policy_from_toml_tables_env_and_flag(tmp_path):
    toml = tmp_path / "epd.toml"
    toml.write_text('latency_num_sms = 32\nthroughput_num_sms = 16\nservice_class_policy = [\n'
                    '  {groups = "decode-*", class = "latency"},\n'
                    '  {groups = "*", uids = [1001, 1002], class = "throughput", '
                    'most = "latency"},\n'
                    '  {groups = "*", class = "throughput"},\n]\n')
    cfg = load(["--config", str(toml)])
    assert cfg.service_class_policy == ("decode-*=latency, *@1001+1002=throughput/latency, "
                                        "*=throughput")
    assert (cfg.latency_num_sms, cfg.throughput_num_sms) == (32, 16)
    assert config.load(None, cfg.to_env()) == cfg  # what the engines get
    env = {"EPD_SERVICE_CLASS_POLICY": "x-*=latency"}
    assert load(["--config", str(toml)], env).service_class_policy == "x-*=latency"
    assert load(["--service-class-policy", "y=throughput"], env).service_class_policy == \
        "y=throughput"
    toml.write_text('[epd]\nservice_class_policy = "decode-*=latency"\n')
    assert load(["--config", str(toml)]).service_classes.rules[0].default == "latency"


@pytest.mark.parametrize("toml,words", [
    ('service_class_policy = 3\n', "expected a string or a list of tables"),
    ('service_class_policy = ["a=latency"]\n', "entry 1: expected a table"),
    ('service_class_policy = [{groups = "a", class = "latency", colour = 1}]\n',
     "entry 1: unknown keys ['colour']"),
    ('service_class_policy = [{groups = "a"}]\n', "entry 1: needs groups"),
    ('service_class_policy = [{groups = "a,b", class = "latency"}]\n', "may not contain"),
    ('service_class_policy = [{groups = "a", class = "latency", uids = ["me"]}]\n',
     "uids must be a list of numbers"),
    ('service_class_policy = [{groups = "a", class = "latency"}, '
     '{groups = "b", class = "slow"}]\n', "rule 2 'b=slow': unknown service class 'slow'"),
    # a value pasted into the rule text must not make more rules (it widened the allowlist)
    ('service_class_policy = [{groups = "d-*", class = "throughput, *=latency"}]\n',
     "entry 1: class 'throughput, *=latency' is not a class name"),
    ('service_class_policy = [{groups = "d-*", class = "throughput", '
     'most = "latency, *=latency"}]\n', "entry 1: most 'latency, *=latency' is not"),
    ('throughput_num_sms = -1\n', "throughput_num_sms must lie in [0, 1024]"),
    ('latency_num_sms = 5000\n', "latency_num_sms must lie in [0, 1024]"),
])
def test_bad_toml_policies_and_budgets(tmp_path, toml, words):
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    with pytest.raises(ValueError) as ei:
        load(["--config", str(path)])
    assert words in str(ei.value) and "\n" not in str(ei.value), str(ei.value)


def test_serve_rejects_a_bad_policy_in_one_line():
    r = subprocess.run([sys.executable, "-m", "epd.server.cli", "serve",
                        "--service-class-policy", "decode-*=fast"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "EPD_SOCKET_DIR": "/nonexistent/epd"})
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "configuration error" in lines[0], r.stderr
    assert "rule 1 'decode-*=fast': unknown service class 'fast'" in lines[0]


LAT, THR, UNSPEC = epd_pb2.LATENCY, epd_pb2.THROUGHPUT, epd_pb2.SERVICE_CLASS_UNSPECIFIED


def test_class_by_pattern_and_uid_first_match_wins():
    p = sc.parse_policy("decode-*=latency, prefill-*=throughput, *@1001+1002=throughput/latency,"
                        " *@7=latency")
    # defaults by name
    assert p.resolve("decode-0", 5, UNSPEC) == LAT
    assert p.resolve("prefill-0", 5, UNSPEC) == THR
    assert p.resolve("decode-0", 5, LAT) == LAT
    assert p.resolve("decode-0", 5, THR) == THR  # less than allowed is always fine
    # by uid: 1001 may ask for latency anywhere but prefill (rule 2 comes first)
    assert p.resolve("other", 1001, UNSPEC) == THR
    assert p.resolve("other", 1001, LAT) == LAT
    assert p.resolve("other", 7, UNSPEC) == LAT
    with pytest.raises(PermissionDenied, match=r"rule 2 'prefill-\*=throughput'"):
        p.resolve("prefill-0", 1001, LAT)
    # no rule matches: a policy is an allowlist
    with pytest.raises(PermissionDenied) as ei:
        p.resolve("other", 5, LAT)
    assert "fallback '*=throughput' (no rule matches)" in ei.value.details
    assert "uid 5" in ei.value.details and "at most throughput" in ei.value.details
    assert p.resolve("other", 5, UNSPEC) == THR
    # no policy at all: anything may be asked, throughput unless asked
    assert sc.Policy().resolve("x", 5, UNSPEC) == THR
    assert sc.Policy().resolve("x", 5, LAT) == LAT
    with pytest.raises(InvalidArgument, match="service_class=7 is not a ServiceClass"):
        sc.Policy().resolve("x", 5, 7)


def test_sm_budgets_and_stream_priorities():
    cfg = SimpleNamespace(latency_num_sms=0, throughput_num_sms=8)
    assert sc.kernel_blocks(cfg, LAT, 24, 64) == (24, 64)  # no budget: the daemon's
    assert sc.kernel_blocks(cfg, THR, 24, 64) == (8, 8)
    cfg = SimpleNamespace(latency_num_sms=96, throughput_num_sms=0)
    assert sc.kernel_blocks(cfg, LAT, 24, 64) == (96, 64)  # low-latency: at most the budget
    # a client's num_sms is bounded by what its group may use
    member = SimpleNamespace(comm=SimpleNamespace(num_sms=8))
    assert StreamCalls._num_sms(member, 20) == 8
    assert StreamCalls._num_sms(member, 4) == 4
    assert StreamCalls._num_sms(member, 0) == 0  # 0: the group's own
    with pytest.raises(InvalidArgument):
        StreamCalls._num_sms(member, -1)


@pytest.mark.parametrize("name", ["num_sms", "ll_num_sms", "latency_num_sms",
                                  "throughput_num_sms"])
def test_block_counts_above_the_gpus_sms_are_refused_at_start(name):
    """A grid larger than the GPU's SMs could not be resident at once (the kernels spin on
    their peers' blocks): the engine refuses the setting when it opens its GPU, naming it."""
    cfg = SimpleNamespace(num_sms=0, ll_num_sms=64, latency_num_sms=0, throughput_num_sms=0)
    sc.check_blocks(cfg, 132, 0, 64)  # the defaults pass
    sc.check_blocks(cfg, 40, 0, 64)  # the low-latency default too (the engine takes <= 40)
    setattr(cfg, name, 133)
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag}=133 exceeds the 132 SMs of GPU 1"):
        sc.check_blocks(cfg, 132, 1, 64)
    setattr(cfg, name, 132)
    sc.check_blocks(cfg, 132, 1, 64)
    # CUDA's range (least, greatest) is e.g. (0, -5): lower is more urgent
    assert sc.stream_priority(LAT, 0, -5) == -5 and sc.stream_priority(THR, 0, -5) == 0


# ------------------------------------------------------------------------------------ daemon

def _join(s: Session, name: str, num_ranks: int = 1, rank: int = 0, **kw):
    return s.join(name, rank=rank, num_ranks=num_ranks, num_experts=2 * num_ranks, hidden=128,
                  max_tokens_per_rank=8, num_topk=1, **kw)


def _groups(s: Session) -> dict[str, epd_pb2.GroupStats]:
    return {g.name: g for g in s.stats().groups}


def test_default_class_by_pattern(daemon):
    with Session(daemon.socket(0), timeout=10) as s:
        got = {n: _join(s, n).service_class
               for n in ("svc-decode-a", "svc-prefill-a", "svc-other-a", "svc-open-a")}
        assert got == {"svc-decode-a": "latency", "svc-prefill-a": "throughput",
                       "svc-other-a": "throughput", "svc-open-a": "throughput"}
        stats = _groups(s)
        assert stats["svc-decode-a"].service_class == LAT
        assert stats["svc-prefill-a"].service_class == THR
        # the cpu backend keeps the class, and has no streams or SMs to schedule
        assert {(g.stream_priority, g.num_sms, g.ll_num_sms) for g in stats.values()} == \
            {(0, 0, 0)}
        # our uid may ask for latency on svc-open-*; the rule for another uid does not apply
        assert _join(s, "svc-open-b", service_class="latency").service_class == "latency"


def test_join_asks_unknown_class(daemon):
    with Session(daemon.socket(0), timeout=10) as s:
        with pytest.raises(EpdError) as ei:
            _join(s, "svc-x", service_class="urgent")
        assert ei.value.code.name == "INVALID_ARGUMENT"
        spec = epd_pb2.GroupSpec(name="svc-x", num_ranks=1, num_experts=2, hidden=128,
                                 max_tokens_per_rank=8, num_topk=1, x_dtype=epd_pb2.BFLOAT16,
                                 service_class=9)
        with pytest.raises(EpdError) as ei:
            s._call("JoinGroup", epd_pb2.JoinGroupRequest(session_id=s.session_id, spec=spec,
                                                          rank=0, timeout_seconds=5), 10)
        assert ei.value.code.name == "INVALID_ARGUMENT"
        assert "service_class=9 is not a ServiceClass" in ei.value.details
        assert not s.stats().groups


def refused_then_allowed(endpoint: str, case: Case, rank: int) -> dict:
    """Task: ask for latency where the policy allows throughput only (refused), check that
    nothing changed, then join the same group as allowed and run a round."""
    with Session(endpoint, client_name=f"svc-rank{rank}", timeout=20) as s:
        try:
            join(s, case, rank, service_class="latency")
            refusal = None
        except EpdError as e:
            refusal = (e.code.name, e.details)
        before = len(s.stats().groups)
        g = join(s, case, rank, service_class="throughput")
        res = case_round(s, g, case, rank)
        res.update(refusal=refusal, groups_before=before, service_class=g.service_class)
        return res


def test_refusal_on_every_rank_changes_nothing(daemon, ranks):
    c = Case(group="svc-prefill-refused", num_ranks=2, num_experts=4, hidden=128, num_topk=2,
             tokens=(12, 9), seed=3)
    results = ranks.run_ok([(refused_then_allowed, daemon.socket(r), c, r) for r in range(2)])
    for res in results:
        code, details = res["refusal"]
        assert code == "PERMISSION_DENIED", details
        assert "service class latency is not allowed" in details
        assert "--service-class-policy rule 2 'svc-prefill-*=throughput'" in details
        assert res["groups_before"] == 0 and res["service_class"] == "throughput"
    check_case(c, results)


def run_group(endpoint: str, case: Case, rank: int, service_class: str | None) -> dict:
    """Task: join with a class, run the case's rounds, return the results and the stats."""
    with Session(endpoint, client_name=f"svc-rank{rank}", timeout=30) as s:
        g = join(s, case, rank, service_class=service_class)
        res = case_round(s, g, case, rank)
        st = next(x for x in s.stats().groups if x.name == case.group)
        res.update(service_class=g.service_class, stats_class=st.service_class,
                   queued_calls=st.queued_calls, queue_wait=st.queue_wait_seconds)
        return res


def test_a_refused_call_is_not_counted_as_queued(daemon) -> None:
    """GetStats' queued_calls / queue_wait_seconds (and epd_queue_wait_seconds) count the calls
    of a rank that ran: a call refused by its request's checks (a layout, a dispatch and a
    combine here; a review found those and a low-latency combine counted) is not."""
    case = Case("svc-refused-count", 1, 4, 128, 2, (6,), max_tokens=8)
    with Session(daemon.socket(0)) as s:
        g = join(s, case, 0)
        inp = case.inputs(0)
        d = s._descs({"i": np.zeros((6, 3), np.int64), "x": inp["x"],
                      "idx": inp["topk_idx"], "w": inp["topk_weights"]})
        refused = {  # method: (request, the refusal's words)
            "GetDispatchLayout": (epd_pb2.GetDispatchLayoutRequest(
                session_id=s.session_id, group_id=g.group_id, topk_idx=d["i"]),
                "topk_idx has shape [6, 3], expected [6, 2]"),  # (the group's top-k is 2)
            "Dispatch": (epd_pb2.DispatchRequest(
                session_id=s.session_id, group_id=g.group_id, x=d["x"], topk_idx=d["idx"],
                topk_weights=d["w"], expert_alignment=-1), "expert_alignment"),
            "Combine": (epd_pb2.CombineRequest(
                session_id=s.session_id, group_id=g.group_id, handle=424242, x=d["x"]),
                "handle 424242 is not known")}
        for method, (req, words) in refused.items():
            with pytest.raises(EpdError) as ei:
                s._call(method, req)
            assert words in ei.value.details, (method, ei.value)
        st = next(x for x in s.stats().groups if x.name == case.group)
        assert (st.queued_calls, st.queue_wait_seconds) == (0, 0), st
        g.get_dispatch_layout(case.inputs(0)["topk_idx"])
        st = next(x for x in s.stats().groups if x.name == case.group)
        assert st.queued_calls == 1, st


def test_two_classes_concurrently_exact(daemon, ranks):
    decode = Case(group="svc-decode-mix", num_ranks=2, num_experts=8, hidden=256, num_topk=2,
                  tokens=(24, 17), seed=11, rounds=4)
    prefill = Case(group="svc-prefill-mix", num_ranks=2, num_experts=4, hidden=512,
                   num_topk=3, tokens=(64, 80), seed=12, rounds=4)
    calls = [(run_group, daemon.socket(r % 2), decode, r, "latency") for r in range(2)] + \
        [(run_group, daemon.socket((r + 1) % 2), prefill, r, None) for r in range(2)]
    results = ranks.run_ok(calls)
    check_case(decode, results[:2])
    check_case(prefill, results[2:])
    for res, cls in zip(results, ("latency",) * 2 + ("throughput",) * 2, strict=True):
        assert res["service_class"] == cls
        assert res["stats_class"] == epd_pb2.ServiceClass.Value(cls.upper())
        # layout + 4 x (dispatch + combine), each accounted with its wait
        assert res["queued_calls"] == 9 and res["queue_wait"] >= 0
    ss = samples(daemon)
    for group, cls in (("svc-decode-mix", "latency"), ("svc-prefill-mix", "throughput")):
        assert value(ss, "epd_queue_wait_seconds_count", group=group, service_class=cls) == 18
        assert value(ss, "epd_queue_wait_seconds_bucket", group=group, service_class=cls,
                     le="+Inf") == 18
        # ranks held, by class: none now (the sessions closed), the series stays at 0
        assert value(ss, "epd_group_service_class", group=group, service_class=cls) == 0
        assert value(ss, "epd_bytes_sent_total", group=group) > 0


def mismatched(endpoint: str, case: Case, rank: int, service_class: str) -> tuple:
    """Task: join with a class the other rank does not ask for; (code, details)."""
    with Session(endpoint, client_name=f"svc-rank{rank}", timeout=10) as s:
        try:
            join(s, case, rank, service_class=service_class)
            return ("OK", "")
        except EpdError as e:
            return (e.code.name, e.details)


def test_ranks_that_disagree_on_the_class_fail_together(daemon, ranks):
    c = Case(group="svc-open-mismatch", num_ranks=2, num_experts=4, hidden=128, num_topk=1,
             tokens=(4, 4))
    outs = ranks.run_ok([(mismatched, daemon.socket(r), c, r, cls)
                         for r, cls in enumerate(("latency", "throughput"))])
    assert len({code for code, _ in outs}) == 1 and outs[0][0] == "FAILED_PRECONDITION", outs
    assert any("service_class=latency" in d and "service_class=throughput" in d
               for _, d in outs), outs


def test_class_gauge_stats_and_topology(daemon):
    with Session(daemon.socket(1), timeout=10) as s:
        _join(s, "svc-decode-gauge")
        _join(s, "svc-prefill-gauge")
        ss = samples(daemon)
        assert value(ss, "epd_group_service_class", group="svc-decode-gauge",
                     service_class="latency") == 1
        assert value(ss, "epd_group_service_class", group="svc-prefill-gauge",
                     service_class="throughput") == 1
        r = subprocess.run([sys.executable, "-m", "epd.server.cli", "topology",
                            "--socket-dir", daemon.socket_dir], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        line = next(x for x in r.stdout.splitlines() if "service classes" in x)
        assert sc.parse_policy(POLICY).text in line
        assert "SM budgets latency default, throughput 8" in line
        assert "1 latency" in line and "1 throughput" in line
    ss = samples(daemon)
    assert value(ss, "epd_group_service_class", group="svc-decode-gauge",
                 service_class="latency") == 0


def test_group_memory_is_reported(daemon):
    """Issue 14: what a group holds in the engine, per rank in GetStats and per group in
    `epd_group_held_bytes` (0 once the daemon holds none of its ranks)."""
    with Session(daemon.socket(1), timeout=10) as s:
        _join(s, "svc-prefill-held")
        st = next(g for g in s.stats().groups if g.name == "svc-prefill-held")
        assert st.held_bytes > 0
        assert value(samples(daemon), "epd_group_held_bytes",
                     group="svc-prefill-held") == st.held_bytes
    assert value(samples(daemon), "epd_group_held_bytes", group="svc-prefill-held") == 0


def test_group_sm_budget_is_exported(daemon):
    """Issue 14: `epd_group_sms{group, mode}` says what GetStats says per rank (the budget the
    CUDA engine gives the group's kernels; the cpu backend has none: 0), and 0 once no rank of
    the group is held."""
    with Session(daemon.socket(0), timeout=10) as s:
        _join(s, "svc-decode-sms")
        st = next(g for g in s.stats().groups if g.name == "svc-decode-sms")
        ss = samples(daemon)
        assert value(ss, "epd_group_sms", group="svc-decode-sms", mode="normal") == st.num_sms
        assert value(ss, "epd_group_sms", group="svc-decode-sms",
                     mode="low_latency") == st.ll_num_sms
    ss = samples(daemon)
    assert value(ss, "epd_group_sms", group="svc-decode-sms", mode="normal") == 0


def test_buffer_service_class(daemon, monkeypatch):
    with pytest.raises(InvalidArgument, match="service_class must be one of"):
        Buffer(rank=0, num_ranks=1, socket_dir=daemon.socket_dir, engine=0,
               service_class="bulk")
    idx = np.zeros((4, 1), np.int64)
    buf = Buffer(rank=0, num_ranks=1, socket_dir=daemon.socket_dir, engine=0,
                 group_name="svc-open-buf", service_class="latency")
    try:
        buf.get_dispatch_layout(idx, 2)
        assert {g.service_class for g in buf.session.stats().groups} == {LAT}
    finally:
        buf.destroy()
    monkeypatch.setenv("EPD_SERVICE_CLASS", "latency")  # frameworks that build the Buffer
    buf = Buffer(rank=0, num_ranks=1, socket_dir=daemon.socket_dir, engine=0,
                 group_name="svc-prefill-buf")
    try:
        with pytest.raises(EpdError) as ei:
            buf.get_dispatch_layout(idx, 2)
        assert ei.value.code.name == "PERMISSION_DENIED"
        assert "rule 2 'svc-prefill-*=throughput'" in ei.value.details
    finally:
        buf.destroy()


def test_instance_tags_are_left_out_of_policy_and_labels() -> None:
    """The DeepEP facade tags each Buffer's groups (`name@tag`): a policy pattern names the
    kind of group, and the metrics label it without the tag (the label budget is not spent on
    every new job)."""
    from epd.server import metrics

    policy = sc.parse_policy("deep_ep/*-ll*=latency/latency")
    tagged = "deep_ep/h7168-k8-bfloat16-e256-ll128@0a1b2c3d4e5f"
    assert policy.resolve(tagged, 1000, 0) == epd_pb2.LATENCY
    assert metrics.group_label(tagged) == "deep_ep/h7168-k8-bfloat16-e256-ll128"
