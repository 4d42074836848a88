"""server/backends/cuda_chain_loop.py without a GPU: what EPD_CHAIN_LOOP selects, and what a
loop that cannot be built does (graph: the chain goes on with its host top-up, after a
warning; require: the chain fails to start, so a GPU test cannot pass on the fallback)."""

from __future__ import annotations

import logging

import pytest

from epd.proto import abi
from epd.server.backends import cuda_chain_loop


class _Unbuildable:
    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("cudaGraphConditionalHandleCreate: cudaErrorNotSupported")


def test_a_loop_that_cannot_be_built_falls_back_unless_required(monkeypatch, caplog) -> None:
    monkeypatch.setattr(cuda_chain_loop, "ChainLoop", _Unbuildable)
    monkeypatch.setattr(cuda_chain_loop, "REQUIRED", False)
    with caplog.at_level(logging.WARNING, logger="epd.engine"):
        assert cuda_chain_loop.build(0, [], None, None) is None
    assert "cudaErrorNotSupported" in caplog.text and "host tops the chain up" in caplog.text
    monkeypatch.setattr(cuda_chain_loop, "REQUIRED", True)
    with pytest.raises(RuntimeError, match="cudaErrorNotSupported"):
        cuda_chain_loop.build(0, [], None, None)


def test_the_loop_source_takes_its_state_word_from_the_abi() -> None:
    text = cuda_chain_loop.SOURCE.read_text()
    assert "#define LLS_K" not in text  # (the builder puts abi.LLS_K first: one definition)
    assert "state[LLS_K] += 1" in text
    assert abi.LLS_K < abi.LLS_WORDS and abi.CHAIN_K_LOOP == 2**64 - 1


def test_the_loop_kernel_is_loaded_at_start_or_the_engine_refuses(monkeypatch, caplog) -> None:
    """EPD_CHAIN_LOOP: the engine links and loads epd_ll_loop_next before it serves (a module
    load waits for a spinning loop); off, nothing is built; graph, a failure warns; require,
    it stops the engine's start."""
    calls: list[int] = []

    def unlinkable(device_id: int):
        calls.append(device_id)
        raise RuntimeError("EPD_CHAIN_LOOP=graph needs libcudadevrt.a")

    monkeypatch.setattr(cuda_chain_loop, "loop_next_kernel", unlinkable)
    monkeypatch.setattr(cuda_chain_loop, "LOOP", False)
    cuda_chain_loop.preload(0)
    assert calls == []
    monkeypatch.setattr(cuda_chain_loop, "LOOP", True)
    monkeypatch.setattr(cuda_chain_loop, "REQUIRED", False)
    with caplog.at_level(logging.WARNING, logger="epd.engine"):
        cuda_chain_loop.preload(1)
    assert calls == [1] and "libcudadevrt.a" in caplog.text
    monkeypatch.setattr(cuda_chain_loop, "REQUIRED", True)
    with pytest.raises(RuntimeError, match="libcudadevrt"):
        cuda_chain_loop.preload(2)
