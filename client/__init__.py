"""EPD client library: what a worker process imports.

`Session` / `Group` is the native API; `Buffer` is the DeepEP-compatible facade.
"""

from ..proto.errors import EpdError
from .buffer import Buffer, EventOverlap
from .group import DispatchResult, Group, Handle, PendingDispatch
from .session import Session

__all__ = ["Buffer", "DispatchResult", "EpdError", "EventOverlap", "Group", "Handle",
           "PendingDispatch", "Session"]
