"""The metrics' `group` label of a tenant's group (server/metrics.owned_label): group names are
each uid's own, so the label carries the owner's uid where the namespace is a tenant's own. The
whole path, two users' same-named groups as two series, runs in tests/test_multi_user.py."""

from __future__ import annotations

import dataclasses
import os

from epd.server import metrics
from epd.server.backends.base import GroupSpec


def test_a_tenants_groups_are_labelled_with_its_uid() -> None:
    me, other = os.geteuid(), os.geteuid() + 1
    assert metrics.owned_label("moe@tag1", me, shared=False) == "moe"  # the daemon's own uid
    assert metrics.owned_label("moe@tag1", other, shared=True) == "moe (pool)"
    assert metrics.owned_label("moe@tag1", me, shared=True) == "moe (pool)"
    assert metrics.owned_label("moe@tag1", other, shared=False) == f"moe (uid {other})"


def test_no_name_takes_another_owners_label() -> None:
    """A name that ends like an owner gets its own owner as well: the daemon uid's or a pool's
    group named `moe (uid N)` does not write tenant N's series of `moe`."""
    me, other = os.geteuid(), os.geteuid() + 1
    tenants = metrics.owned_label("moe", other, shared=False)
    for name, uid, shared in ((f"moe (uid {other})", me, False),
                              (f"moe (uid {other})", other + 1, False),
                              (f"moe (uid {other})", me, True), ("moe (pool)", me, False)):
        label = metrics.owned_label(name, uid, shared)
        assert label != tenants and label != metrics.owned_label("moe", me, True), label
    assert metrics.owned_label("moe (uid 7)", me, False) == f"moe (uid 7) (uid {me})"
    assert metrics.owned_label("moe (v2)", me, False) == "moe (v2)"  # (not an owner's)


def test_the_label_is_no_part_of_the_specs_identity() -> None:
    spec = GroupSpec("moe@t", 2, 8, 128, 16, 2, 0)
    assert spec.label == "moe@t"  # unset: the name (group_label drops the tag)
    labelled = dataclasses.replace(spec, metrics_name="moe (uid 7)")
    assert labelled.label == "moe (uid 7)"
    assert labelled == spec and hash(labelled) == hash(spec)  # (ranks compare specs)
