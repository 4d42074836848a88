"""What a forked child inherits of a Session, and may not touch.

A process that forks (a DataLoader's workers, a multiprocessing pool with the fork start method)
gives the child a copy of every Session, Buffer and Group object, with the parent's session
token, fast-path ring, counter page and gRPC channel. A child that used them would act as the
parent: its calls take the parent's ring sequence numbers (the parent's next call then waits
out its deadline), its `close()` or a Buffer's `__del__` at its exit leaves the parent's
groups and marks the parent's ring closed. So a session records the fork generation it was
opened in: in a later one (a child), its calls raise FAILED_PRECONDITION and closing it only
forgets it, touching nothing shared with the parent.
"""

from __future__ import annotations

import os

_generation = 0  # forks this process is removed from its ancestors' sessions by


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1


os.register_at_fork(after_in_child=_after_fork_in_child)


def generation() -> int:
    """The current process's fork generation (recorded by a session at its opening)."""
    return _generation


def inherited(opened_in: int) -> bool:
    """Whether an object made in generation `opened_in` was inherited through a fork."""
    return opened_in != _generation


def refusal(pid: int) -> str:
    return (f"this session was opened by process {pid}; a forked child cannot use it (its "
            f"token, ring and groups are the parent's): open a new Session or Buffer in the "
            f"child")
