"""EPD client library: what a worker process imports.

`Session` / `Group` is the native API; `Buffer` is the DeepEP-compatible facade.
"""

from epd.client.buffer import Buffer, EventOverlap
from epd.client.errors import EpdError
from epd.client.session import DispatchResult, Group, Handle, PendingDispatch, Session

__all__ = ["Buffer", "DispatchResult", "EpdError", "EventOverlap", "Group", "Handle",
           "PendingDispatch", "Session"]
