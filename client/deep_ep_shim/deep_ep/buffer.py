"""`deep_ep.buffer` for EPD: the module DeepEP V1 defines `Buffer` in (deep_ep/buffer.py at
commit 567632dd5981), for code that imports it from there (`from deep_ep.buffer import Buffer`,
as Mooncake's tests do). The names DeepEP's module has: `Buffer`, and the `Config`,
`EventHandle`, `EventOverlap` and `check_nvlink_connections` it imports."""

from epd.client.buffer import Buffer
from epd.client.deep_ep_compat import Config

from .utils import EventHandle, EventOverlap, check_nvlink_connections

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "check_nvlink_connections"]
