"""Group names, as the daemon's rendezvous matches them node-wide, and their instance tags.

A name may end in `@<tag>`: the DeepEP facade tags each Buffer's groups with a token its ranks
agree on, so that two Buffers (two EP groups, two jobs) of one shape never meet in one daemon
group. The tag is part of the name for the rendezvous, and is left out where names are kinds
rather than instances: the service-class policy's patterns and the metrics' `group` label (a
tag per Buffer would spend the label budget on every new job)."""

from __future__ import annotations

INSTANCE_SEP = "@"


def tagged(base: str, tag: str) -> str:
    """`base` with instance tag `tag` (none when empty)."""
    return f"{base}{INSTANCE_SEP}{tag}" if tag else base


def base_name(name: str) -> str:
    """A group name without its instance tag."""
    return name.split(INSTANCE_SEP, 1)[0]
