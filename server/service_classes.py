"""Service classes (issue 14): which class a group gets, which it may ask for, and what a class
means to the kernels (README "Service classes and SM budgets").

A group is `latency` (decode: short, latency-bound calls) or `throughput` (prefill, training:
long calls). The class is decided once per group, at join, by the daemon's policy
(`--service-class-policy`): an ordered list of rules, the first one matching the group's name
(an fnmatch pattern) and, where the rule names uids, the joining client's uid, gives the class
a join that asks for none gets and the most a join may ask for (latency > throughput). Asking
for more is PERMISSION_DENIED naming the rule. With no policy every group may ask for either
class and gets throughput by default; once a policy is set, a group no rule matches gets
throughput and may ask for nothing more (an allowlist).

Compact syntax (flag, environment, TOML string): rules separated by commas,
`PATTERN[@UID[+UID...]]=CLASS[/MOST]`, e.g.
`decode-*=latency, prefill-*=throughput, *@1001+1002=throughput/latency`. TOML may also give a
list of tables, `{groups = "decode-*", uids = [1001], class = "latency", most = "latency"}`,
turned into the same text (`policy_text`).

Device-free and backend-agnostic: the engine resolves classes, the CUDA backend asks
`sm_budget` for a class's cap on its kernels' blocks.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from ..proto import group_names
from ..proto.errors import InvalidArgument, PermissionDenied
from ..proto.v1 import epd_pb2

LATENCY, THROUGHPUT = "latency", "throughput"
CLASS_NAMES = (LATENCY, THROUGHPUT)
_BY_NAME = {LATENCY: epd_pb2.LATENCY, THROUGHPUT: epd_pb2.THROUGHPUT}
_BY_VALUE = {v: k for k, v in _BY_NAME.items()}
_RANK = {THROUGHPUT: 0, LATENCY: 1}  # "more" is more urgent
MAX_NUM_SMS = 1024  # a per-class budget above this is a typo, not a GPU
TOML_KEYS = ("groups", "uids", "class", "most")


def name(value: int) -> str:
    """'latency' / 'throughput' for a ServiceClass value ('unspecified' for 0)."""
    return _BY_VALUE.get(value, "unspecified")


def value(class_name: str) -> int:
    """The ServiceClass value of 'latency' / 'throughput' (ValueError otherwise)."""
    try:
        return _BY_NAME[class_name]
    except KeyError:
        raise ValueError(f"unknown service class {class_name!r} (latency or throughput)") \
            from None


def check_value(v: int) -> None:
    """A ServiceClass value from the wire: INVALID_ARGUMENT unless known (0 = unspecified)."""
    if v != epd_pb2.SERVICE_CLASS_UNSPECIFIED and v not in _BY_VALUE:
        raise InvalidArgument(f"service_class={v} is not a ServiceClass (0 unspecified, "
                              f"1 latency, 2 throughput)")


@dataclass(frozen=True)
class Rule:
    pattern: str  # fnmatch on the group name
    uids: frozenset[int]  # empty: any client
    default: str  # the class of a join that asks for none
    most: str  # the most a join may ask for
    index: int  # 1-based position in the policy (0: the built-in fallback)

    def matches(self, group: str, uid: int | None) -> bool:
        # (a group's instance tag is left out: a pattern names a kind of group)
        return fnmatch.fnmatchcase(group_names.base_name(group), self.pattern) and (
            not self.uids or (uid is not None and uid in self.uids))

    @property
    def text(self) -> str:
        who = "@" + "+".join(str(u) for u in sorted(self.uids)) if self.uids else ""
        classes = self.default if self.most == self.default else f"{self.default}/{self.most}"
        return f"{self.pattern}{who}={classes}"

    def describe(self) -> str:
        if not self.index:
            return f"the policy's fallback {self.text!r} (no rule matches)"
        return f"--service-class-policy rule {self.index} {self.text!r}"


OPEN = Rule("*", frozenset(), THROUGHPUT, LATENCY, 0)  # no policy: anything may be asked
CLOSED = Rule("*", frozenset(), THROUGHPUT, THROUGHPUT, 0)  # a policy, and no rule matches


@dataclass(frozen=True)
class Policy:
    rules: tuple[Rule, ...] = ()

    @property
    def fallback(self) -> Rule:
        return CLOSED if self.rules else OPEN

    def rule_for(self, group: str, uid: int | None) -> Rule:
        return next((r for r in self.rules if r.matches(group, uid)), self.fallback)

    def resolve(self, group: str, uid: int | None, requested: int) -> int:
        """The class a join of `group` by a client of `uid` gets (a ServiceClass value):
        the rule's default when `requested` is unspecified; PERMISSION_DENIED naming the rule
        when it is more than the rule allows. Changes nothing."""
        check_value(requested)
        rule = self.rule_for(group, uid)
        if requested == epd_pb2.SERVICE_CLASS_UNSPECIFIED:
            return _BY_NAME[rule.default]
        asked = name(requested)
        if _RANK[asked] > _RANK[rule.most]:
            who = f"uid {uid}" if uid is not None else "a client of unknown uid"
            raise PermissionDenied(
                f"group {group!r}: service class {asked} is not allowed for {who} by "
                f"{rule.describe()}: at most {rule.most}")
        return requested

    @property
    def text(self) -> str:
        return ", ".join(r.text for r in self.rules)


def parse_policy(text: str) -> Policy:
    """The compact syntax (module docstring); ValueError naming the rule that is wrong."""
    rules = []
    items = [t.strip() for t in str(text).split(",")]
    if len(items) == 1 and not items[0]:
        return Policy()
    for i, item in enumerate(items, 1):
        where = f"service_class_policy rule {i} {item!r}"
        if not item:
            raise ValueError(f"service_class_policy: rule {i} is empty (rules are separated by "
                             f"single commas)")
        selector, eq, classes = item.rpartition("=")
        if not eq or not selector.strip():
            raise ValueError(f"{where}: expected PATTERN[@UID[+UID...]]=CLASS[/MOST]")
        pattern, at, uid_text = selector.strip().partition("@")
        pattern = pattern.strip()
        if not pattern:
            raise ValueError(f"{where}: the group name pattern is empty (use * for any group)")
        if "=" in pattern or "@" in uid_text:
            raise ValueError(f"{where}: a pattern may not contain '=' or '@'")
        uids: frozenset[int] = frozenset()
        if at:
            try:
                uids = frozenset(int(u) for u in uid_text.split("+"))
            except ValueError:
                raise ValueError(f"{where}: uids after '@' must be numbers joined by '+', got "
                                 f"{uid_text!r}") from None
            if any(u < 0 for u in uids):
                raise ValueError(f"{where}: uids must be >= 0")
        default, slash, most = (c.strip() for c in classes.partition("/"))
        for c in (default, most) if slash else (default,):
            if c not in CLASS_NAMES:
                raise ValueError(f"{where}: unknown service class {c!r} (latency or "
                                 f"throughput)")
        most = most if slash else default
        if _RANK[default] > _RANK[most]:
            raise ValueError(f"{where}: the default class {default} is more than the most "
                             f"allowed, {most}")
        rules.append(Rule(pattern, uids, default, most, i))
    return Policy(tuple(rules))


def policy_text(raw: Any) -> str:
    """A policy setting as the compact text: a string as it is, a TOML list of tables
    (`groups`, `uids`, `class`, `most`) converted. ValueError naming the entry otherwise."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise ValueError(f"service_class_policy: expected a string or a list of tables, got "
                         f"{type(raw).__name__}")
    out = []
    for i, entry in enumerate(raw, 1):
        where = f"service_class_policy entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected a table {{groups = ..., class = ...}}")
        unknown = set(entry) - set(TOML_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)} (known: "
                             f"{list(TOML_KEYS)})")
        pattern, cls = entry.get("groups"), entry.get("class")
        if not isinstance(pattern, str) or not isinstance(cls, str):
            raise ValueError(f"{where}: needs groups (a pattern) and class (latency or "
                             f"throughput) as strings")
        if any(c in pattern for c in ",=@"):
            raise ValueError(f"{where}: a pattern may not contain ',', '=' or '@'")
        uids = entry.get("uids", [])
        if not isinstance(uids, list) or not all(isinstance(u, int) and not isinstance(u, bool)
                                                 for u in uids):
            raise ValueError(f"{where}: uids must be a list of numbers")
        who = "@" + "+".join(str(u) for u in uids) if uids else ""
        most = entry.get("most")
        if most is not None and not isinstance(most, str):
            raise ValueError(f"{where}: most must be a string (latency or throughput)")
        for key, v in (("class", cls), ("most", most or "")):
            if any(c in v for c in ",=@/"):  # (pasted into the rule text: one entry, one rule)
                raise ValueError(f"{where}: {key} {v!r} is not a class name (latency or "
                                 f"throughput)")
        out.append(f"{pattern}{who}={cls}" + (f"/{most}" if most else ""))
    return ", ".join(out)


def sm_budget(config: Any, service_class: int) -> int:
    """The class's cap on the blocks of the data kernels (0: none, the daemon's defaults)."""
    if service_class == epd_pb2.LATENCY:
        return int(config.latency_num_sms)
    if service_class == epd_pb2.THROUGHPUT:
        return int(config.throughput_num_sms)
    return 0


def kernel_blocks(config: Any, service_class: int, num_sms: int,
                  ll_num_sms: int) -> tuple[int, int]:
    """(normal-mode, low-latency) blocks of a group's data kernels, from the daemon's
    defaults (--num-sms, --ll-num-sms) and the class's budget: normal mode uses the budget
    (a share of the GPU the operator gives the class), low-latency at most it (its kernels
    are latency-bound: more blocks only while they fit)."""
    budget = sm_budget(config, service_class)
    if not budget:
        return num_sms, ll_num_sms
    return budget, min(budget, ll_num_sms)


def check_blocks(config: Any, device_sms: int, device: int, default_ll: int) -> None:
    """Refuse block counts above the GPU's SMs (ValueError naming the setting): the data
    kernels spin on their peers' blocks, so a grid that cannot be resident at once waits for
    blocks that never start, until the call's deadline. Checked when an engine opens its GPU,
    the first moment the count is known. The low-latency default (64, `default_ll`) is not
    refused: the engine takes at most the GPU's SMs for it, so a smaller GPU starts."""
    for name in ("num_sms", "ll_num_sms", "latency_num_sms", "throughput_num_sms"):
        n = int(getattr(config, name) or 0)
        if name == "ll_num_sms" and n == default_ll:
            continue
        if n > device_sms:
            raise ValueError(f"--{name.replace('_', '-')}={n} exceeds the {device_sms} SMs "
                             f"of GPU {device}")


def stream_priority(service_class: int, least: int, greatest: int) -> int:
    """The CUDA priority of a rank stream of this class, from the device's range (least,
    greatest; lower numbers are more urgent): latency the greatest, throughput the least (the
    priority of every other stream, so throughput work is never favoured over anything)."""
    return greatest if service_class == epd_pb2.LATENCY else least
