"""`import deep_ep` resolving to EPD (opt-in: `pip install ./client/deep_ep_shim`).

DeepEP V1's public names (deep_ep/__init__.py at commit 567632dd5981) over EPD's daemon:
`Buffer`, `Config`, `EventOverlap`, `topk_idx_t`, and its submodules `deep_ep.buffer`
(`Buffer`, where DeepEP defines it) and `deep_ep.utils` (`EventHandle`, `EventOverlap`,
`check_nvlink_connections`); and DeepEP V2's (deep_ep 2.1.0, commit dd758ca): `ElasticBuffer`,
`EPHandle`, `EventHandle`, `get_physical_domain_size`, `get_logical_domain_size`. What EPD
supports and what raises is tabled in EPD's README (DeepEP section).
"""

from ._guard import check as _check

_check()

import torch  # noqa: E402

from epd.client.buffer import Buffer, BufferHandle, LowLatencyBufferHandle  # noqa: E402
from epd.client.deep_ep_compat import Config, EventHandle, EventOverlap, Unsupported  # noqa: E402
from epd.client.elastic_buffer import (  # noqa: E402
    ElasticBuffer,
    EPHandle,
    get_logical_domain_size,
    get_physical_domain_size,
)

from . import buffer, utils  # noqa: E402

topk_idx_t = torch.int64
IS_EPD = True  # tells EPD's shim apart from DeepEP

__all__ = ["IS_EPD", "Buffer", "BufferHandle", "Config", "EPHandle", "ElasticBuffer",
           "EventHandle", "EventOverlap", "LowLatencyBufferHandle", "Unsupported", "buffer",
           "get_logical_domain_size", "get_physical_domain_size", "topk_idx_t", "utils"]
