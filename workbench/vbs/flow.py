"""The executor's memory over a plan, step by step: where every waiting sample lies, and the copies.

For "Variable batch size across layers for efficient prediction on CNNs" (Choudhury et al.),
Section III. The DP's accounting (recurrences (1)-(3), Fig 4) has every sample in exactly one
place: a step at L_i uses in(i, q) + ws(i, q) + out(i, q), pending inputs and finished outputs are
reserved, and a consumed input is gone. A PyTorch executor can match that between steps, but not
at every moment, because one layer call reads one tensor and writes one new tensor:

- a step whose samples wait in several tensors (the outputs of earlier phases, or the request's
  samples) gathers them with `torch.cat`: the merged copy exists beside its sources until they are
  dropped, just before the layer runs;
- a step that takes the first samples of a larger tensor reads a view of it; right after the
  layer ran, the rest is copied out and the tensor dropped ("compaction"), so no consumed sample
  stays allocated. Inputs the executor does not own (a branch's views of its group's input, a
  request tensor the caller keeps) are read as views and never copied.

`Flow` follows exactly that, step by step, and returns the highest live memory during each step
(`Step.executed`). `account` writes it into a plan: its predicted peak is then what the executor
allocates, copies included, never less than the DP's own accounting. It runs on the tables (memory
units, `table_sizes`) when a planner makes a plan, and on the real tensors' bytes (`byte_sizes`)
when the executor checks, before running, that a plan holds for the inputs it was given.

# NOTE: the copies are what gathering and splitting cost in PyTorch, not a margin: the DP plans
# with the paper's accounting, and a plan whose copies do not fit its budget is planned again at
# a smaller budget (`dynamic_program.Planner.plan`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

from .layers import LayerProfile
from .schedule import REQUESTS, Plan, Step

__all__ = ["Flow", "Sizes", "account", "table_sizes", "byte_sizes", "check_units"]

# (chain, boundary, samples) -> memory of that many samples waiting at the boundary (the input of the
# chain's layer `boundary`; one past its last layer: the chain's output). chain is None for the main
# path, (s, a) for branch a of the special layer s; a branch's boundary 0 is its group's input.
Sizes = Callable[[tuple[int, int] | None, int, int], int]


def table_sizes(layers: LayerProfile) -> Sizes:
    """Sizes from the tables (memory units): a waiting chunk costs what the layer that made it wrote."""
    def size(chain, boundary: int, count: int) -> int:
        if count == 0:
            return 0
        if chain is None:
            return int(layers.inp[0, count - 1] if boundary == 0 else layers.out[boundary - 1, count - 1])
        part = layers.branches[chain[0]][chain[1]]
        return 0 if boundary == 0 else int(part.out[boundary - 1, count - 1])
    return size


def byte_sizes(main: list[int], branches: dict[int, list[list[int]]], unit: int) -> Sizes:
    """Sizes from per-sample bytes (`main[k]`: at main boundary k; `branches[s][a][k]`: after branch
    a's layer k), rounded up to whole `unit`s of the plan they are compared with."""
    def size(chain, boundary: int, count: int) -> int:
        if chain is None:
            nbytes = main[boundary] * count
        else:
            nbytes = 0 if boundary == 0 else branches[chain[0]][chain[1]][boundary - 1] * count
        return -(-nbytes // unit)
    return size


class Flow:
    """Live memory while a plan runs: chunks waiting at each boundary, in `sizes`' unit.

    `request` is how the request's samples are handed over: "pieces" (one tensor per sample, each
    freed when consumed: what the DP's in(1, b - b1) counts) or "kept" (one tensor the caller keeps:
    read as views, never copied, and counted whole until the call returns). `posts` are the branch
    groups whose `post` (the ReLU after a residual sum) writes a new tensor rather than working in
    place: the tables do not see that copy, so a plan made from them is refused by the executor there.
    """

    def __init__(self, sizes: Sizes, batch: int, *, request: str = "pieces", posts: frozenset[int] = frozenset()
                 ) -> None:
        if request not in REQUESTS:
            raise ValueError(f"request must be one of {list(REQUESTS)}, got {request!r}")
        self.size, self.pieces, self.posts = sizes, request == "pieces", posts
        self.queues: dict[tuple, deque[int]] = {(None, 0): deque([batch])}
        self.live = sizes(None, 0, batch)  # the request, whichever way it is handed over
        self.peak = self.live

    def copy(self) -> Flow:
        """An independent copy (to try a step and keep it or not)."""
        other = Flow.__new__(Flow)
        other.size, other.pieces, other.posts = self.size, self.pieces, self.posts
        other.live, other.peak = self.live, self.peak
        other.queues = {k: deque(v) for k, v in self.queues.items()}
        return other

    def _cost(self, key: tuple, count: int) -> int:
        return self.size(key[0], key[1], count)

    def _take(self, key: tuple, q: int) -> tuple[int, int, int]:
        """Gather q samples waiting at `key`: (live memory at its highest meanwhile, memory of the
        layer's input to drop after the layer, size of the chunk whose first samples were taken)."""
        queue = self.queues.get(key)
        if not queue or sum(queue) < q:
            raise ValueError(f"the plan asks for {q} samples at {_where(key)}, but only "
                             f"{sum(queue or ())} are waiting there")
        if key == (None, 0) and self.pieces:  # the request's samples, one tensor each
            pending = queue[0]
            queue[0] -= q
            if not queue[0]:
                queue.popleft()
            freed = self._cost(key, pending) - self._cost(key, pending - q)
            if q == 1:
                return self.live, freed, 0
            merged = self._cost(key, q)
            peak, self.live = self.live + merged, self.live + merged - freed
            return peak, merged, 0
        whole, need, head = [], q, 0
        while need:
            c = queue.popleft()
            if c > need:  # the first samples of a larger chunk: a view of it
                queue.appendleft(c - need)
                head, need = c, 0
            else:
                whole.append(c)
                need -= c
        if key[1] == 0:  # views of a tensor the executor does not own (a group's input, a kept request)
            return self.live, 0, 0
        if len(whole) + bool(head) == 1:
            return self.live, (self._cost(key, whole[0]) if whole else 0), head
        merged = self._cost(key, q)
        peak = self.live + merged
        self.live += merged - sum(self._cost(key, w) for w in whole)
        return peak, merged, head

    def run(self, step: Step, chain: tuple[int, int] | None = None, length: int = 0) -> Step:
        """One step (a branch group with all its branches' steps): `step` with `executed` set to
        the highest live memory while it runs. `length` is the number of layers of `chain`'s branch."""
        i, q = step.layer, step.batch
        key = (chain, i)
        gather, drop, head = self._take(key, q)
        out = self.size(chain, i + 1, q)
        inner = []
        if step.branches:
            self.live += out  # the group's output, which its branches write into
            peak = max(gather, self.live)
            for a, branch in enumerate(step.branches):
                self.queues[((i, a), 0)] = deque([q])  # views of the group's input
                n = max((s.layer for s in branch), default=-1) + 1
                inner.append(tuple(self.run(s, (i, a), n) for s in branch))
                peak = max([peak, *(s.executed for s in inner[-1])])
            if chain is None and i in self.posts:  # the group's post writes a new tensor, then the output is dropped
                peak = max(peak, self.live + out)
        else:
            ws = max(0, step.used - self._cost(key, q) - out)
            peak = max(gather, self.live + ws + out)
            self.live += out
        self.live -= drop
        if head:  # compaction: the rest of the chunk copied out, then the chunk dropped
            rest = self.queues[key][0]
            peak = max(peak, self.live + self._cost(key, rest))
            self.live += self._cost(key, rest) - self._cost(key, head)
        if chain is not None and i + 1 == length:
            self.live -= out  # a branch's output, copied into its group's output and dropped
        else:
            self.queues.setdefault((chain, i + 1), deque()).append(q)
        self.peak = max(self.peak, peak)
        return replace(step, executed=peak, branches=tuple(inner))

    def finish(self, n_layers: int) -> int:
        """Gather the outputs into one tensor where they are several: the live memory meanwhile (0
        where nothing is gathered)."""
        chunks = self.queues.get((None, n_layers), deque())
        if len(chunks) < 2:
            return 0
        gather = self.live + self.size(None, n_layers, sum(chunks))
        self.peak = max(self.peak, gather)
        return gather


def _where(key: tuple) -> str:
    chain, boundary = key
    return f"layer {boundary}" if chain is None else f"layer {boundary} of branch {chain[1]} of layer {chain[0]}"


def account(plan: Plan, sizes: Sizes, *, request: str = "pieces", posts: frozenset[int] = frozenset()
            ) -> tuple[Plan, int]:
    """(`plan` with every step's `executed` set to the executor's live memory during it, the
    executor's peak over the whole run, the outputs' gathering included). The plan's `peak` is
    the higher of that and the DP's own accounting (which can be above it by rounding: the DP
    rounds every reserved part to whole units on its own)."""
    flow = Flow(sizes, plan.batch, request=request, posts=posts)
    steps = [flow.run(s) for s in plan.steps]
    gather = flow.finish(len(plan.names))  # after the last step: counted as part of it
    steps[-1] = replace(steps[-1], executed=max(steps[-1].executed, gather))
    return replace(plan, steps=steps), flow.peak


def check_units(layers: LayerProfile) -> int:
    """Memory of one sample through the model (`Plan.check`): the largest in + ws + out at batch 1,
    the first layer's input included; for a branch group its input and output, every branch's output
    (the model's own forward holds them all until it merges them, where the executor writes each into
    the group's output) and the hungriest branch layer."""
    need = layers.inp[:, 0] + layers.ws[:, 0] + layers.out[:, 0]
    for s, parts in layers.branches.items():
        held = sum(int(p.out[-1, 0]) for p in parts if p.n_layers)
        inner = max((int((p.inp[k, 0] if k else 0) + p.ws[k, 0] + p.out[k, 0]) for p in parts
                     for k in range(p.n_layers)), default=0)
        need[s] = int(layers.inp[s, 0] + layers.out[s, 0]) + held + inner
    return int(need.max())
