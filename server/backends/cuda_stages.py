"""Two-stage hierarchical normal mode on the CUDA engine (issue 13): DeepEP's internode traffic
made of the flat kernels.

A group of N nodes x L ranks placed node-major (rank = node * L + local index) runs, per
rank, three flat collectives (docs/DESIGN_NOTES.md, "Hierarchical normal mode in two stages"):
- the whole group's **notify** (its flat slot, notify-only; beyond MAX_RANKS ranks
  `epd_wide_notify`): the receive counts published to the caller's counter page as on one
  node, the rank prefix matrix, a call every rank fails alike (capacity, bad input), which
  both stages then skip alike;
- the **rail** stage: a flat group of the N ranks with this local index, one per node, rank b
  holding node b's E / N experts. A token crosses the network once per destination node, to
  the rank with its own local index there (the forwarder); its top-k ids arrive node-local;
- the **node** stage: a flat group of the node's L ranks (by pointer), dispatching what the
  forwarder received with those ids.
Combine runs the stages backwards: the node stage sums a token's rows per node (rounded to the
combine dtype: a forwarder's partial), the rail stage sums the partials and the biases at the
source. Composed this way the results are `reference.hierarchical_dispatch` /
`hierarchical_combine`, which are themselves composed of the flat functions.

A `StagedRunner` call is a generator: it launches its stages, all of them on the rank's one
stream, and then yields each runner whose error word the driver checks once the stream is done.
So one thread can drive one rank (the engine's answered calls, `drive`) or several ranks in
lock-step (the GPU tests); a stream-ordered call takes the first step alone and leaves the
checking to the GPU (`launch`: the stages, then the fold of their failures for the call's
done kernel).

The host does not wait between the stages. The rail stage pads its outputs to N x T
rows, the most a forwarder can receive, as a worst-token dispatch does: padding rows carry
expert id -1 and go nowhere. So the node stage's input has a size known before the rail stage
runs. The padding costs the rows a forwarder did not receive (few: with top-k over E experts
nearly every token has an expert on every node), written as zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from .base import GroupSpec, Hierarchy
from .cuda_plan import peer_table, stage_layouts
from .cuda_runtime import DispatchResult, RankRunner

T = TypeVar("T")
Steps = Generator[RankRunner, None, T]


@dataclass
class StagedResult:
    """What a two-stage dispatch filled; combine and cached dispatch reuse it."""

    flat: DispatchResult  # the whole group's notify: counts and rank prefix matrix
    rail: DispatchResult
    node: DispatchResult


class StagedRunner:
    """One rank of a two-stage group: its whole-group runner (`flat`, notify only) and its
    runners in the rail and node stage groups, with the forwarder's combine partials
    (`partial_x` [N x T, hidden] in the combine dtype's storage, `partial_w` [N x T, top-k]
    float32)."""

    def __init__(self, flat: RankRunner, rail: RankRunner, node: RankRunner,
                 hierarchy: Hierarchy, rank: int, partial_x: Any, partial_w: Any) -> None:
        self.flat, self.rail, self.node = flat, rail, node
        self.hierarchy = hierarchy
        self.rank = rank
        self.partial_x, self.partial_w = partial_x, partial_w
        node_index, local = divmod(rank, hierarchy.per_node)
        ln = hierarchy.per_node
        # The group rank of each rank of a stage group (errors name group ranks).
        self.group_ranks = {
            id(flat): list(range(hierarchy.num_ranks)),
            id(rail): [a * ln + local for a in range(hierarchy.num_nodes)],
            id(node): [node_index * ln + j for j in range(ln)]}
        self.stage_names = {id(flat): "notify", id(rail): "rail stage",
                            id(node): "node stage"}

    @property
    def runners(self) -> tuple[RankRunner, RankRunner, RankRunner]:
        return self.flat, self.rail, self.node

    def group_rank(self, runner: RankRunner, stage_rank: int) -> int:
        ranks = self.group_ranks[id(runner)]
        return ranks[stage_rank] if 0 <= stage_rank < len(ranks) else stage_rank

    def dispatch_result(self, num_tokens: int, cached: StagedResult | None,
                        num_worst_tokens: int) -> StagedResult:
        """What a dispatch will fill, before it is launched (a stream-ordered call answers with
        its outputs first): new handles, or a cached dispatch's."""
        rows = self.rail.layout.max_recv  # (the rail outputs, padded: the module docstring)
        if cached is not None:
            return StagedResult(cached.flat,
                                self.rail.dispatch_result(num_tokens, cached.rail, rows),
                                self.node.dispatch_result(rows, cached.node, num_worst_tokens))
        return StagedResult(self.flat.dispatch_result(num_tokens, None, 0),
                            self.rail.dispatch_result(num_tokens, None, rows),
                            self.node.dispatch_result(rows, None, num_worst_tokens))

    def dispatch(self, x: Any, x_scales: Any | None, topk_idx: Any | None,
                 topk_weights: Any | None, *, alignment: int = 1, num_worst_tokens: int = 0,
                 cached: StagedResult | None = None, counter_slot_ptr: int = 0,
                 counter_seq: int | None = None, timeout_ns: int, num_sms: int,
                 result: StagedResult | None = None, refused: int = 0) -> Steps[StagedResult]:
        """Notify (new dispatches), rail stage, node stage, in stream order; then yields the
        three runners (notify's first: the driver reads the published counts while the stages
        run). A cached dispatch reuses both stages' handles (no notify). `result`: the one
        `dispatch_result` made for this call (else made here). Everything is launched by the
        first step, so a stream-ordered call takes that step alone. `refused`: the whole
        group's notify carries it as this rank's verdict (`refused_dispatch`)."""
        import cupy as cp

        if result is None:
            result = self.dispatch_result(int(x.shape[0]), cached, num_worst_tokens)
        flat = result.flat
        # A call the whole group's notify fails on every rank alike (bad input, capacity) is
        # skipped alike by both stages (their notifies read its status: `fail_from`).
        failed = None
        if cached is None:
            self.flat.notify(topk_idx, flat, alignment=alignment,
                             counter_slot_ptr=counter_slot_ptr, counter_seq=counter_seq,
                             timeout_ns=timeout_ns, bad_alike=True, refused=refused)
            failed = flat.handle.recv_info
            # The padding rows a forwarder did not receive: ids -1 (the node stage sends such
            # a row nowhere).
            ids = self.rail.views["recv_topk_idx"]
            cp.cuda.runtime.memsetAsync(ids.data.ptr, 0xFF, ids.nbytes, self.rail.stream.ptr)
        rows = self.rail.layout.max_recv  # N x T: the rail outputs padded (module docstring)
        rail = self.rail.dispatch(x, x_scales, topk_idx, topk_weights, timeout_ns=timeout_ns,
                                  num_sms=num_sms, num_worst_tokens=rows,
                                  cached=cached.rail if cached is not None else None,
                                  result=result.rail, fail_from=failed)
        got = self.rail.output_views(rail, rows)
        fwd_x = got["recv_x"]
        if fwd_x.dtype.itemsize != x.dtype.itemsize:  # FP8 rows in the bf16-sized buffer
            fwd_x = cp.ndarray((rows, x.shape[1]), x.dtype, memptr=fwd_x.data)
        fwd_scales = got.get("recv_x_scales") if x_scales is not None else None
        if fwd_scales is not None:  # (rows packed at the call's scale width: cuda.py)
            fwd_scales = cp.ndarray((rows, int(x_scales.shape[1])), x_scales.dtype,
                                    memptr=fwd_scales.data)
        node = self.node.dispatch(fwd_x, fwd_scales, got.get("recv_topk_idx"),
                                  got.get("recv_topk_weights"), alignment=alignment,
                                  num_worst_tokens=num_worst_tokens, timeout_ns=timeout_ns,
                                  num_sms=num_sms,
                                  cached=cached.node if cached is not None else None,
                                  result=result.node, fail_from=failed)
        assert rail is result.rail and node is result.node
        if cached is None:
            yield self.flat  # (a failed notify fails the call on every rank alike)
        yield self.rail
        yield self.node
        return result

    def combine(self, y: Any, res: StagedResult, out: Any, *, recv_topk_weights: Any = None,
                out_weights: Any = None, bias_0: Any = None, bias_1: Any = None,
                timeout_ns: int, num_sms: int) -> Steps[None]:
        """Node stage (a partial per token and node at the forwarder), then rail stage (the
        partials and the biases summed at the source), in stream order on the rank's one
        stream (`build`): no host wait."""
        rows = self.rail.layout.max_recv  # (the rail outputs, padded: dispatch)
        partial = self.partial_x[:rows]
        partial_w = self.partial_w[:rows] if recv_topk_weights is not None else None
        self.node.combine(y, res.node, partial, recv_topk_weights=recv_topk_weights,
                          out_weights=partial_w, timeout_ns=timeout_ns, num_sms=num_sms)
        self.rail.combine(partial, res.rail, out, recv_topk_weights=partial_w,
                          out_weights=out_weights, bias_0=bias_0, bias_1=bias_1,
                          timeout_ns=timeout_ns, num_sms=num_sms)
        yield self.node  # (one stream: both are done; each runner's error is checked)
        yield self.rail

    def refused_dispatch(self, num_topk: int, hidden: int, itemsize: int, refused: int,
                         timeout_ns: int) -> Steps[StagedResult]:
        """This rank's part of a dispatch its engine refused: the whole group's notify of no
        tokens with the verdict `refused` (ERR_REFUSED: every rank fails the call alike) and
        both stages, which skip it alike (their notifies read that status), so that every
        stage's sequences stay every rank's. Its inputs and handles are kept until the next
        one (the kernels read them after this returns)."""
        import cupy as cp

        x = cp.empty((0, hidden), {1: cp.uint8, 2: cp.uint16, 4: cp.float32}[itemsize])
        idx = cp.empty((0, num_topk), cp.int64)
        w = cp.empty((0, num_topk), cp.float32)
        result = self.dispatch_result(0, None, 0)
        self._refused = (x, idx, w, result)
        return self.dispatch(x, None, idx, w, timeout_ns=timeout_ns, num_sms=1,
                             result=result, refused=refused)

    def outputs(self, res: StagedResult) -> dict[str, Any]:
        """As `RankRunner.outputs` (host reads; after the node stage): the node stage's rows
        (recv_src_rank: the forwarder's local index), the whole group's rank prefix matrix."""
        out = self.node.outputs(res.node)
        out["rank_prefix"] = res.flat.handle.rank_prefix
        return out

    def launch(self, steps: Steps[Any]) -> None:
        """A stream-ordered call: its first step launches every stage; then the fold of a
        stage's failure into this rank's whole-group control block (epd_stage_errors), the one
        that the call's done kernel reads, the stage's rank there becoming the group rank. The
        host checks nothing (the GPU does)."""
        next(steps)
        steps.close()
        self.flat.k.stage_errors(self.flat.peers, self.rank, self.rail.views["ctrl"],
                                 self.node.views["ctrl"], self.hierarchy.per_node,
                                 stream=self.flat.stream)

    def error(self) -> tuple[int, int, str, int] | None:
        """The first error word set among the three runners, its rank a group rank."""
        for runner in self.runners:
            err = runner.error()
            if err is not None:
                code, missing, phase, seq = err
                return code, self.group_rank(runner, missing), phase, seq
        return None


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks are, for the peer tables (cuda_plan.peer_table's arguments): each
    rank's node and engine, this engine's node, this node's engines' heap bases, this engine's
    heap base and each node's first PE."""

    rank_nodes: tuple[int, ...]
    rank_engines: tuple[int, ...]
    node: int
    engine_bases: dict[int, int]
    heap_base: int
    node_first_pe: tuple[int, ...]

    def peers(self, members: list[int], offset: int,
              slot: int) -> tuple[list[int], dict[int, tuple[int, int]]]:
        """`peer_table` for the stage group of the group ranks `members` (its rank s is group
        rank members[s]), whose slots lie at `offset + group rank * slot` of every heap."""
        bases: list[int] = []
        remote: dict[int, tuple[int, int]] = {}
        for s, m in enumerate(members):
            b, r = peer_table((self.rank_nodes[m],), (self.rank_engines[m],), self.node,
                              offset + m * slot, 0, self.engine_bases, self.heap_base,
                              self.node_first_pe)
            bases.append(b[0])
            if 0 in r:
                remote[s] = r[0]
        return bases, remote

    def all_ranks(self, offset: int, slot: int) -> Any:
        """The kernels' table of every rank's slot at `offset + rank * slot` (for an abort)."""
        from .cuda_runtime import peer_array
        return peer_array(*peer_table(self.rank_nodes, self.rank_engines, self.node, offset,
                                      slot, self.engine_bases, self.heap_base,
                                      self.node_first_pe))


def build(flat: RankRunner, spec: GroupSpec, hierarchy: Hierarchy, place: Placement, base: int,
          kernels: Any, remote_kernels: Any, owner: Any, stream_priority: int,
          partials: tuple[Any, Any]) -> tuple[StagedRunner, list[Any]]:
    """Rank `flat.rank`'s stage runners at the group's heap offset `base` (every PE's): the
    rail through the NVSHMEM build (every other rank of a rail is on another node), the node
    stage by pointer. Returns the staged runner and the abort tables of every rank's rail and
    node control blocks (a stage kernel waits on its own block only)."""
    from .cuda_runtime import RankRunner

    lays = stage_layouts(spec, hierarchy)
    ln = hierarchy.per_node
    node_index, local = divmod(flat.rank, ln)
    rail_peers, rail_remote = place.peers([a * ln + local for a in range(hierarchy.num_nodes)],
                                          base + lays.rail_at(0), lays.rail_bytes)
    node_peers, node_remote = place.peers([node_index * ln + j for j in range(ln)],
                                          base + lays.node_at(0), lays.node_bytes)
    assert not node_remote, "a node stage is on one node"
    # The stages run on the rank's own streams: they follow each other anyway, and a stream
    # per stage would triple the hardware queues a rank takes (beyond
    # CUDA_DEVICE_MAX_CONNECTIONS streams share queues).
    common = {"device_id": flat.device_id, "x_dtype": flat.x_dtype, "y_dtype": flat.y_dtype,
              "owner": owner, "stream_priority": stream_priority,
              "streams": (flat.stream, flat.side_stream)}
    rail = RankRunner(remote_kernels, lays.rail, node_index, rail_peers, remote=rail_remote,
                      **common)
    node = RankRunner(kernels, lays.node, local, node_peers, **common)
    tables = [place.all_ranks(base + lays.rail_at(0), lays.rail_bytes),
              place.all_ranks(base + lays.node_at(0), lays.node_bytes)]
    return StagedRunner(flat, rail, node, hierarchy, flat.rank, *partials), tables


def drive(steps: Steps[T], wait: Callable[[RankRunner], None]) -> T:
    """Run one rank's staged call: `wait(runner)` at every step (the engine synchronises the
    runner's stream and raises its error)."""
    try:
        runner = next(steps)
        while True:
            wait(runner)
            runner = steps.send(None)
    except StopIteration as done:
        return done.value
