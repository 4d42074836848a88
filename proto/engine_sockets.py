"""The names of an engine's sockets in the daemon's socket folder, shared by daemon and client.

Every engine serves gRPC on `gpu<D>.sock` (D: the device it runs on) and the descriptor channel
beside it (`gpu<D>.fds`, fd_channel.socket_path_for). With class engines (`epd serve
--class-engines`) each device has a second engine that runs only latency groups, on
`gpu<D>.latency.sock`; the engine on `gpu<D>.sock` then runs only throughput groups. A
latency group's launches thus never wait behind a throughput group's driver calls in the same
process (docs/DESIGN_NOTES.md, "Class engines"). A tenant pool (`epd serve --tenant-pools`)
has engines of its own on every device, on `gpu<D>.tenant-<pool>.sock` (and
`gpu<D>.latency.tenant-<pool>.sock`): its sessions' memory lies in its own processes and heaps
(docs/DESIGN_NOTES.md, "Tenant pools").
"""

from __future__ import annotations

import os
import re

LATENCY = "latency"  # (service_classes.LATENCY; the client cannot import the server)
# How a class engine's refusal of a group of the other class names the socket to use: the
# client's Buffer reopens its session there (client/buffer.py).
OTHER_ENGINE_HINT = "open the session on "


def socket_name(device: int, service_class: str = "", tenant_pool: str = "") -> str:
    """gpu<D>.sock; gpu<D>.latency.sock for a latency class engine; .tenant-<pool> before
    .sock for a tenant pool's engine."""
    latency = ".latency" if service_class == LATENCY else ""
    pool = f".tenant-{tenant_pool}" if tenant_pool else ""
    return f"gpu{device}{latency}{pool}.sock"


def socket_path(folder: str, device: int, service_class: str = "", tenant_pool: str = "") -> str:
    return os.path.join(folder, socket_name(device, service_class, tenant_pool))


def failure_file(socket: str) -> str:
    """Where an engine that could not start leaves its reason: gpu0.sock -> gpu0.failed."""
    return (socket[:-len(".sock")] if socket.endswith(".sock") else socket) + ".failed"


# An engine socket's own name (socket_name): what a followed hint may name.
_ENGINE_SOCKET = r"gpu\d+(?:\.latency)?(?:\.tenant-[a-z0-9][a-z0-9-]*)?\.sock"


def hinted_socket(message: str, beside: str) -> str | None:
    """The socket a class or tenant pool engine's refusal names (OTHER_ENGINE_HINT), if any, in
    the folder of `beside` (the endpoint the client used): only an engine socket's own name
    (`gpu<D>[.latency][.tenant-<pool>].sock`) after the hint's last occurrence is taken, never
    its folder. The refusal may carry other clients' words (a group's abort reason names its
    sessions' client names), so a peer could otherwise send a Buffer to a socket of its own
    making (a review); and the client may see the socket folder at another path than the
    daemon (a bind mount), or the folder's name may itself hold `.sock`."""
    at = message.rfind(OTHER_ENGINE_HINT)
    if at < 0:
        return None
    m = re.match(r"(?:.*/)?(" + _ENGINE_SOCKET + r")(?=[\s.,;:)]|$)",
                 message[at + len(OTHER_ENGINE_HINT):])
    if m is None:
        return None
    folder = os.path.dirname(beside.removeprefix("unix://").removeprefix("unix:"))
    return os.path.join(folder, m.group(1))
