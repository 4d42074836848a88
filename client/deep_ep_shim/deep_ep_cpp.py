"""`deep_ep_cpp` for EPD's deep_ep shim: the names code imports from DeepEP's extension module
directly (xtuner: `from deep_ep_cpp import EventHandle`), as EPD's facade defines them. There is
no C++ runtime here: the daemon runs the kernels."""

import torch

from epd.client.deep_ep_compat import Config, EventHandle

topk_idx_t = torch.int64
IS_EPD = True  # tells EPD's module apart from DeepEP's extension (the shim's guard)
__all__ = ["IS_EPD", "Config", "EventHandle", "topk_idx_t"]
