"""`deep_ep.utils` for EPD: DeepEP V1's `EventHandle`, `EventOverlap` and
`check_nvlink_connections`."""

from epd.client.deep_ep_compat import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]


def check_nvlink_connections(group) -> None:
    """DeepEP checks that the group's GPUs are NVLink-connected, for its in-process kernels.
    EPD's daemon chooses the transport between its engines, so there is nothing to check."""
    return None
