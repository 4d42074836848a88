"""The daemon's open-files limit: raised at start, and checked against what the budgets allow
(the budgets do not count descriptors)."""

from __future__ import annotations

import contextlib
import logging
import resource

from .config import Config

log = logging.getLogger("epd.supervisor")


def raise_open_files_limit() -> None:
    """The soft limit of open descriptors up to the hard one, for this process and the engines
    it forks (as Go's runtime does): every session holds descriptors (a region's mapping, a
    group's, channel connections), and a shell's 1024 lets a few sessions exhaust an engine
    (a fuzzer: another tenant's OpenSession then failed with "Too many open files"). The
    budgets do not count descriptors: size LimitNOFILE to the sessions and regions allowed
    (README, "Operating it")."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20  # (Linux's default nr_open)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


# What one session can hold open in an engine at its budgets: a descriptor per region (its
# mapping keeps one), about three per group, and its own few (counter page, fast-path ring,
# descriptor-channel connections); the engine's own take the reserve.
SESSION_DESCRIPTORS, GROUP_DESCRIPTORS, RESERVED_DESCRIPTORS = 8, 3, 256


def check_open_files_limit(cfg: Config) -> None:
    """Warn when the open-files limit does not cover the sessions the budgets allow: the
    budgets do not count descriptors, so past the limit the engine refuses whoever comes next
    (RESOURCE_EXHAUSTED), another tenant as likely as the one that used them up."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    per_session = (cfg.max_regions_per_session + GROUP_DESCRIPTORS * cfg.max_groups_per_session
                   + SESSION_DESCRIPTORS)
    need = cfg.max_sessions * per_session + RESERVED_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < need:
        log.warning("the open-files limit (%d) covers about %d full sessions of an engine at the "
                    "per-session budgets (~%d descriptors each), not --max-sessions %d: raise "
                    "LimitNOFILE (ulimit -n) to %d or more, or lower the budgets", soft,
                    max(0, soft - RESERVED_DESCRIPTORS) // per_session, per_session,
                    cfg.max_sessions, need)
