"""A world over all nodes: when node 0 forms it and when it is lost (cluster mode, for backends
whose engines form one world across nodes: the CUDA engine's NVSHMEM world, where a PE cannot
be replaced). Pure state, no I/O: `ClusterHub` reports every node's lease and the world
generation its engines run in, and acts on what `WorldKeeper` answers.

The handshake: node 0 forms world g once every node holds a lease and runs no engines (reports
generation 0); every node starts its engines in g when it hears of it (node 0 at once, the
others from the lease stream) and reports g. The world is lost when a node that had joined it
goes away, restarts (a new incarnation) or reports another generation (its engine died, so it
stopped the others); node 0 then stops its own engines and leaves the world out of its lease
events, the other nodes stop theirs and report 0, and g + 1 is formed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class NodeState:
    incarnation: str
    engines: int
    generation: int  # the world its engines run in (0: none)
    left: int = 0  # the latest world it left (its engine died or could not start there)


@dataclass
class World:
    generation: int
    node_first_pe: tuple[int, ...]
    num_pes: int


@dataclass
class WorldKeeper:
    num_nodes: int
    generation: int = 0
    world: World | None = None  # formed and not lost
    _incarnations: dict[int, str] = field(default_factory=dict)
    _joined: set[int] = field(default_factory=set)

    def lost(self, nodes: dict[int, NodeState]) -> str | None:
        """Why the current world is lost, given every live node (node 0 included), or None.
        Once it says so, the world is gone (`world` is None)."""
        if self.world is None:
            return None
        why = None
        for rank in range(self.num_nodes):
            n = nodes.get(rank)
            if n is None:
                why = f"node {rank} went away"
            elif n.incarnation != self._incarnations[rank]:
                why = f"node {rank} restarted"
            elif n.generation == self.generation:
                self._joined.add(rank)
                continue
            elif n.left >= self.generation:
                why = f"node {rank}'s engines could not run in world {self.generation}"
            elif rank in self._joined:
                why = f"node {rank}'s engines left the world (one of them exited)"
            else:
                continue  # not started in it yet
            break
        if why is not None:
            self.world = None
            self._joined.clear()
        return why

    def abandon(self, why: str) -> str:
        """Node 0 lost the current world itself (its engine could not start, the world could
        not be made): gone, as `lost` would say, and `why` returned."""
        self.world = None
        self._joined.clear()
        return why

    def form(self, nodes: dict[int, NodeState]) -> World | None:
        """A new world when none is formed, every node holds a lease and none runs engines."""
        if self.world is not None or any(
                r not in nodes or nodes[r].generation != 0 for r in range(self.num_nodes)):
            return None
        first, pe = [], 0
        for r in range(self.num_nodes):
            first.append(pe)
            pe += nodes[r].engines
        self.generation += 1
        self._incarnations = {r: nodes[r].incarnation for r in range(self.num_nodes)}
        self._joined.clear()
        self.world = World(self.generation, tuple(first), pe)
        return self.world
