"""The metrics' `group` label of a tenant's group (server/metrics.owned_label): group names are
each uid's own, so the label carries the owner's uid where the namespace is a tenant's own. The
whole path, two users' same-named groups as two series, runs in tests/test_multi_user.py."""

from __future__ import annotations

import dataclasses
import os

from epd.server import metrics
from epd.server.backends.base import GroupSpec


def test_a_tenants_groups_are_labelled_with_its_uid() -> None:
    me, other = os.getuid(), os.getuid() + 1
    assert metrics.owned_label("moe@tag1", me, shared=False) == "moe"  # the daemon's own uid
    assert metrics.owned_label("moe@tag1", other, shared=True) == "moe"  # a shared pool's
    assert metrics.owned_label("moe@tag1", other, shared=False) == f"moe (uid {other})"


def test_the_label_is_no_part_of_the_specs_identity() -> None:
    spec = GroupSpec("moe@t", 2, 8, 128, 16, 2, 0)
    assert spec.label == "moe@t"  # unset: the name (group_label drops the tag)
    labelled = dataclasses.replace(spec, metrics_name="moe (uid 7)")
    assert labelled.label == "moe (uid 7)"
    assert labelled == spec and hash(labelled) == hash(spec)  # (ranks compare specs)
