"""The replicated state's one listener: every change fanned out to the subscribers, the liveness and the key watchers.

What the keys mean is not the agent's business (chitchat's rule): a consumer subscribes to every change of the
replicated state (``GossipAgent.subscribe``: the router's ``ClusterView``) or watches the keys under a prefix
(``GossipAgent.watch``). The core reads only its own keys here: a node appearing starts a life in the membership,
a "left" status ends it, and a "down" key's verdicts go to the liveness. Calls are synchronous, inside the state's
mutation: listeners keep them cheap.
"""

from __future__ import annotations

from collections.abc import Callable

from p2pnode.gossip.keys import DOWN_KEY, LEFT_STATUS, STATUS_KEY
from p2pnode.gossip.liveness import Liveness
from p2pnode.gossip.state import ClusterState, StateListener

__all__ = ["KeyWatcher", "StateFanout"]

KeyWatcher = Callable[[str, str, "bytes | None"], None]


class StateFanout:
    """Fans state changes out to the subscribers, the liveness and the key watchers (in that order)."""

    def __init__(self, liveness: Liveness) -> None:
        self.liveness = liveness
        self._subscribers: list[StateListener] = []
        self._watchers: list[tuple[str, KeyWatcher]] = []

    def subscribe(self, listener: StateListener, state: ClusterState) -> None:
        """Replay ``state`` as it stands to ``listener`` (so it starts complete), then tell it every change."""
        for node_id, node in list(state.nodes.items()):
            listener.on_node_added(node_id, node.generation)
            for key, value in node.items():
                listener.on_key_changed(node_id, key, value)
        self._subscribers.append(listener)

    def watch(self, prefix: str, callback: KeyWatcher) -> None:
        self._watchers.append((prefix, callback))

    def on_node_added(self, node_id: str, generation: int) -> None:
        for subscriber in self._subscribers:
            subscriber.on_node_added(node_id, generation)
        self.liveness.node_appeared(node_id, generation)

    def on_node_removed(self, node_id: str) -> None:
        for subscriber in self._subscribers:
            subscriber.on_node_removed(node_id)

    def on_key_changed(self, node_id: str, key: str, value: bytes | None) -> None:
        for subscriber in self._subscribers:
            subscriber.on_key_changed(node_id, key, value)
        if key == STATUS_KEY and value == LEFT_STATUS:
            self.liveness.node_left(node_id)
        elif key == DOWN_KEY:
            self.liveness.verdicts_heard(node_id, value)
        for prefix, watcher in self._watchers:
            if key.startswith(prefix):
                watcher(node_id, key, value)
