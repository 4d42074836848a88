"""EPD client library: what a worker process imports.

`Session` / `Group` is the native API; `Buffer` is the DeepEP-compatible facade.
"""

from epd.client.errors import EpdError
from epd.client.session import DispatchResult, Group, Handle, PendingDispatch, Session

__all__ = ["DispatchResult", "EpdError", "Group", "Handle", "PendingDispatch", "Session"]
