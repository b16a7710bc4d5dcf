"""An independent, deliberately plain re-implementation of PipeDream's optimizer (msr-fiddle/pipedream,
optimizer/optimizer_graph_hierarchical.py, one level, activation_compression_ratio=1, exactly M machines) over
PipeDream's antichain DAG (graph/graph.py), used as the reference the partitioner is compared against."""

from __future__ import annotations


def load_graph(path):
    """nodes: id -> (desc, forward ms, backward ms, activation bytes, parameter bytes); edges (a, b)."""
    nodes, edges = {}, []
    with open(path) as handle:
        lines = handle.read().splitlines()
    for line in lines:
        if line.startswith("\t"):
            a, b = line.strip().split(" -- ")
            edges.append((a, b))
        elif line.strip():
            tokens = line.strip().split(" -- ")
            meta = dict(kv.split("=", 1) for kv in tokens[2].split(", "))
            act = meta["activation_size"]
            act = sum(float(x) for x in act.strip("[]").split("; ")) if act.startswith("[") else float(act)
            nodes[tokens[0]] = (
                tokens[1],
                float(meta["forward_compute_time"]),
                float(meta["backward_compute_time"]),
                act,
                float(meta["parameter_size"]),
            )
    return nodes, edges


class Graph:
    def __init__(self, nodes, edges):
        self.nodes = dict(nodes)
        self.out = {n: [] for n in nodes}
        self.inc = {n: [] for n in nodes}
        for a, b in edges:
            self.out[a].append(b)
            self.inc[b].append(a)
        drop = [n for n in self.nodes if not self.inc[n] and self.nodes[n][0].startswith("Input")]
        drop += [n for n in self.nodes if not self.out[n] and self.nodes[n][0].startswith("__getitem__")]
        for n in drop:
            for m in self.out.pop(n):
                self.inc[m].remove(n)
            for m in self.inc.pop(n):
                self.out[m].remove(n)
            del self.nodes[n]
        self._pred, self._succ = {}, {}

    def pred(self, n):
        if n not in self._pred:
            s = set()
            for m in self.inc[n]:
                s.add(m)
                s |= self.pred(m)
            self._pred[n] = s
        return self._pred[n]

    def succ(self, n):
        if n not in self._succ:
            s = set()
            for m in self.out[n]:
                s.add(m)
                s |= self.succ(m)
            self._succ[n] = s
        return self._succ[n]

    def augment(self, antichain):
        extra = []
        for a in antichain:
            p = self.pred(a)
            for q in p:
                if any(o not in p and o != a for o in self.out[q]) and q not in extra:
                    extra.append(q)
        return extra + [a for a in antichain if a not in extra]

    def deaugment(self, nodes):
        keep = []
        for x in nodes:
            if not any(y in self.succ(x) for y in nodes) and x not in keep:
                keep.append(x)
        return keep

    def states(self):
        """Antichain DAG: states (augmented antichains) in topological order and transitive predecessors."""
        source = next(n for n in self.nodes if not self.inc[n])
        start = (source,)
        key = lambda ac: tuple(sorted(ac))  # noqa: E731
        seen = {key(start): start}
        edges, queue, done = [], [start], set()
        while queue:
            ac = queue.pop(0)
            if key(ac) in done:
                continue
            done.add(key(ac))
            aug = self.augment(list(ac))
            aug_set = set(aug)
            for x in aug:
                for y in self.out[x]:
                    if y in ac or any(s in aug_set for s in self.succ(y)):
                        continue
                    nxt = tuple(self.deaugment([y if z == x else z for z in aug]))
                    seen.setdefault(key(nxt), nxt)
                    edges.append((key(ac), key(nxt)))
                    queue.append(nxt)
        order = _topo(list(seen), edges)
        index = {k: i for i, k in enumerate(order)}
        preds = {k: set() for k in order}
        for k in order:  # transitive predecessors in topological order
            for a, b in edges:
                if b == k:
                    preds[k] |= {a} | preds[a]
        return [seen[k] for k in order], [sorted(index[p] for p in preds[k]) for k in order]


def _topo(keys, edges):
    indeg = {k: 0 for k in keys}
    for _, b in set(edges):
        indeg[b] += 1
    outs = {k: [] for k in keys}
    for a, b in set(edges):
        outs[a].append(b)
    ready = sorted(k for k in keys if indeg[k] == 0)
    order = []
    while ready:
        k = ready.pop(0)
        order.append(k)
        for b in sorted(outs[k]):
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    return order


def pipedream_objective(path, num_machines, bandwidth=1e9, straight=False):
    """PipeDream's best time per stage (seconds per minibatch) for `num_machines` machines."""
    g = Graph(*load_graph(path))
    states, preds = g.states()
    comp, params, out = [], [], []
    for ac in states:
        aug = g.augment(list(ac))
        everything = set(aug)
        for a in aug:
            everything |= g.pred(a)
        comp.append(sum(g.nodes[n][1] + g.nodes[n][2] for n in everything) / 1000.0)
        params.append(sum(g.nodes[n][4] for n in everything))
        out.append(sum(g.nodes[n][3] for n in aug))
    s_count, big_m = len(states), num_machines
    best = [[None] * big_m for _ in range(s_count)]
    for j in range(s_count):
        for m in range(1 if straight else big_m):
            best[j][m] = (comp[j] + 4 * m * params[j] / (bandwidth * (m + 1))) / (m + 1)
    for m in range(1, big_m):
        for j in range(1, s_count):
            value = best[j][m]
            for k in preds[j]:
                for mp in range(1, 2 if straight else m + 1):
                    if best[k][m - mp] is None:
                        continue
                    last = (comp[j] - comp[k] + 4 * (mp - 1) * (params[j] - params[k]) / (bandwidth * mp)) / mp
                    t = max(best[k][m - mp], last, 2.0 * out[k] / (bandwidth * mp))
                    if j < s_count - 1:
                        t = max(t, 2.0 * out[j] / (bandwidth * mp))
                    if value is None or t < value:
                        value = t
            best[j][m] = value
    return best[s_count - 1][big_m - 1], s_count
