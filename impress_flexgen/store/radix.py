"""A radix tree over prompt token ids whose edges are whole chunks.

Every edge holds a multiple of C tokens, so a match, a split and a node's data all fall on
chunk boundaries. Two children of a node always differ within their first chunk (a common
first chunk would have been split into a shared parent), so children are keyed by it.
The tree holds structure only; the store owns files and metadata.

Each namespace (a tenant) has its own root: requests of different namespaces never share a
node. A node is `exact` when its KV, and that of every node above it, was computed with
full attention over the prefix; an exact-only match stops before the first node that is not.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(eq=False)
class RadixNode:
    id: int
    parent: "RadixNode | None"
    start: int                      # position of the first token in the prefix
    tokens: np.ndarray              # int32, whole chunks
    children: dict = dataclasses.field(default_factory=dict)
    lock_count: int = 0             # requests using this node right now
    hits: int = 0
    last_access: float = 0.0
    layers: list = dataclasses.field(default_factory=list)          # store.LayerEntry per layer
    retired_files: list = dataclasses.field(default_factory=list)   # deleted once unlocked
    live: bool = True
    # The nodes a split replaced this one with: pinned for as long as this one is, so a
    # request's matched tokens stay stored until it releases them.
    successors: list = dataclasses.field(default_factory=list)
    exact: bool = True              # see the module docstring
    namespace: str = ""             # the store's key of its tenant ("" : the shared one)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    def key(self, chunk_size: int) -> tuple:
        return tuple(self.tokens[:chunk_size].tolist())

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, start={self.start}, n={self.n_tokens})"


@dataclasses.dataclass
class PrefixMatch:
    """The chunk-aligned longest prefix of a request found in the tree.

    `segments` are (node, tokens used from its start): whole nodes, and possibly the first
    chunks of one more node that diverges (or ends) later.
    """

    segments: list[tuple[RadixNode, int]]

    @property
    def length(self) -> int:
        return sum(n for _, n in self.segments)

    @property
    def nodes(self) -> list[RadixNode]:
        return [node for node, _ in self.segments]


class RadixTree:
    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self.roots: dict[str, RadixNode] = {}
        self.root = self.root_of("")
        self.nodes: dict[int, RadixNode] = {}

    def __len__(self) -> int:
        return len(self.nodes)

    def root_of(self, namespace: str) -> RadixNode:
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = RadixNode(
                id=0, parent=None, start=0, tokens=np.zeros(0, dtype=np.int32),
                namespace=namespace)
        return root

    def is_root(self, node: RadixNode | None) -> bool:
        return node is not None and node.id == 0 and self.roots.get(node.namespace) is node

    def next_child(self, tokens, match: PrefixMatch, namespace: str = "") -> RadixNode | None:
        """The node a match of `tokens` would continue into (the one it stopped in or
        before), or None."""
        tokens = np.asarray(tokens, dtype=np.int32)
        c = self.chunk_size
        if match.segments:
            last, used = match.segments[-1]
            if used < last.n_tokens:
                return last
            parent, pos = last, last.end
        else:
            parent, pos = self.roots.get(namespace), 0
        if parent is None or pos + c > len(tokens):
            return None
        return parent.children.get(tuple(tokens[pos:pos + c].tolist()))

    def match_prefix(self, tokens, namespace: str = "", exact_only: bool = False) -> PrefixMatch:
        tokens = np.asarray(tokens, dtype=np.int32)
        c = self.chunk_size
        node, pos, segments = self.roots.get(namespace), 0, []
        while node is not None and pos + c <= len(tokens):
            child = node.children.get(tuple(tokens[pos:pos + c].tolist()))
            if child is None or (exact_only and not child.exact):
                break
            n = min(child.n_tokens, (len(tokens) - pos) // c * c)
            same = child.tokens[:n] == tokens[pos:pos + n]
            used = n if same.all() else int(np.argmin(same)) // c * c
            segments.append((child, used))
            if used < child.n_tokens:
                break
            node, pos = child, pos + used
        return PrefixMatch(segments)

    def attach(self, node: RadixNode) -> None:
        parent = node.parent or self.root_of(node.namespace)
        node.parent = parent
        key = node.key(self.chunk_size)
        if key in parent.children and parent.children[key] is not node:
            raise ValueError(f"{parent} already has a child starting with that chunk")
        parent.children[key] = node
        self.nodes[node.id] = node

    def detach(self, node: RadixNode) -> None:
        parent = node.parent or self.root_of(node.namespace)
        if parent.children.get(node.key(self.chunk_size)) is node:
            del parent.children[node.key(self.chunk_size)]
        self.nodes.pop(node.id, None)
        node.live = False

    def replace(self, old: RadixNode, new_nodes: list[RadixNode]) -> None:
        """Swap `old` for a chain of nodes covering the same tokens (a split): the first
        takes old's place under its parent, old's children move under the last."""
        parent = old.parent or self.root_of(old.namespace)
        self.detach(old)
        prev = parent
        for node in new_nodes:
            node.parent = prev
            self.attach(node)
            prev = node
        for child in list(old.children.values()):
            child.parent = prev
            prev.children[child.key(self.chunk_size)] = child

    def path_to(self, node: RadixNode) -> list[RadixNode]:
        path = []
        while node is not None and not self.is_root(node):
            path.append(node)
            node = node.parent
        return path[::-1]

    def subtree(self, node: RadixNode) -> list[RadixNode]:
        out, stack = [], [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def lock(self, match: PrefixMatch) -> None:
        for node in match.nodes:
            self.pin(node)

    def unlock(self, match: PrefixMatch) -> list[RadixNode]:
        """Release a request's nodes; returns those now unlocked (their retired files can go)."""
        return [freed for node in match.nodes for freed in self.unpin(node)]

    @staticmethod
    def pin(node: RadixNode) -> None:
        node.lock_count += 1

    @staticmethod
    def unpin(node: RadixNode) -> list[RadixNode]:
        """Drop one pin of `node` and of the nodes splits replaced it with; returns those
        now unlocked."""
        freed, stack = [], [node]
        while stack:
            n = stack.pop()
            n.lock_count -= 1
            if n.lock_count == 0:
                freed.append(n)
            stack.extend(n.successors)
        return freed

    def evictable_leaves(self) -> list[RadixNode]:
        return [n for n in self.nodes.values() if not n.children and n.lock_count == 0]

