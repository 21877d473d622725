"""A checkpoint placement's trace composed from two traces the advisor makes anyway: the program without checkpoints
and the program with every block checkpointed (issue 45: "checkpointed segments are known from the graph:
recomputation re-plays recorded calls, it is not a new trace").

A placement checkpoints some of a model's repeated blocks (`advisor.blocks.checkpoint_blocks`). Its program runs the
calls of the plain program, plus, for each chosen block, what the every-block program adds for that block: the
checkpoint's own allocations as the block's forward begins (the CPU generator's state, BatchNorm buffers kept) and the
block's recomputation in backward. Both traces are one-step traces at one batch. Every call, allocation, point and
mark of the plain trace is found, in order, in the other (`_aligned`), and what the other adds falls in runs, each
one block's (`_runs`): the placement's trace is the every-block trace less the runs of the blocks not chosen.

When each allocation dies. Its holders are blocks that used it in their forward (`_Tracker.uses`): autograd's saved
tensors in a plain block, a checkpoint's inputs and its recomputation in a checkpointed one. Where both traces free it
at the same place, there. Where every block that used it is checkpointed, or none is, where one trace frees it. Else:
- where the later free falls in the backward of a block whose choice matches its trace (checkpointed in the
  every-block trace, plain in the plain one), that holder runs and the later free is the placement's;
- where the plain program frees it before its backward (no autograd holds it: a DenseNet's feature map, held as an input
  by the checkpoint of every later layer of its dense block), the last to let go of the checkpointed blocks that used
  it; each checkpoint lets go where the every-block trace frees the CPU generator's state it keeps;
- else the earlier free, provided no block that used it and runs in the placement lets go in between.
What cannot be decided so is refused (None) and the placement is traced: a tensor let go in the backward of a block
that never used it is held through an object a checkpoint keeps whole (transformers' key-value cache).

Module labels follow the tracker's: a recomputation that stops early leaves the module it stopped in as the label of
what follows, until the next phase (`_Tracker.mark`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from .derive import _split_bursts
from .tracker import _canonical_frees, _signature, _Trace

__all__: list[str] = []  # used through the advisor's `Plans`

_NEVER = 1 << 62  # the free of an allocation alive at the end


def _stream(trace: _Trace) -> tuple[list[tuple], dict[int, int]] | None:
    """`trace`'s marks, points, calls and allocations in the order they happened, each (kind, index), and where each
    allocation was freed: after which of them (-1: before the first). None where the order cannot be read."""
    events = _split_bursts(trace, trace.points)
    if events is None:
        return None
    marks = sorted(trace.marks, key=lambda name: (trace.marks[name], trace.call_marks[name]))
    points = sorted(range(len(trace.points)), key=lambda i: trace.points[i][2:4])
    tokens, freed, e, c, m, p = [], {}, 0, 0, 0, 0
    while True:
        if m < len(marks) and (trace.marks[marks[m]], trace.call_marks[marks[m]]) == (e, c):
            tokens.append(("mark", marks[m]))
            m += 1
        elif p < len(points) and trace.points[points[p]][2:4] == (e, c):
            tokens.append(("point", points[p]))
            p += 1
        elif c < len(trace.calls) and trace.calls[c][1] <= e:
            tokens.append(("call", c))
            c += 1
        elif e < len(events) and events[e] >= 0:
            tokens.append(("alloc", int(events[e])))
            e += 1
        elif e < len(events):
            freed[int(-events[e] - 1)] = len(tokens) - 1
            e += 1
        else:
            break
    return (tokens, freed) if m == len(marks) and p == len(points) else None


def _key(trace: _Trace, token: tuple) -> tuple:
    kind, i = token
    if kind == "call":
        return kind, trace.calls[i][0], trace.keys[i] if trace.keys else None
    if kind == "alloc":
        return kind, trace.info[i]["op"], int(trace.sizes[i])
    if kind == "point":
        return kind, *trace.points[i][:2]
    return token


def _aligned(plain: list[tuple], every: list[tuple], plain_trace: _Trace, every_trace: _Trace) -> list[int] | None:
    """Where each token of `plain` is in `every` (the first equal one after the previous match that is no part of a
    recomputation), or None where one is missing."""
    # NOTE: by hand, leftmost matching, linear: difflib's longest matching blocks took 0.2 s on a DenseNet-BC-100 step
    # (8,400 and 11,300 tokens). A recomputation's calls (`_Tracker.recomputing`) are never matched: the backward runs
    # calls equal to the forward's (a dropout's mask product, a transpose)
    again = every_trace.recomputing
    keys = [None if (kind == "call" and i in again) or (kind == "alloc" and every_trace.info[i]["call"] in again)
            else _key(every_trace, (kind, i)) for kind, i in every]
    # between two calls of a recomputation, what allocates nothing is the checkpoint's own (a detach under no_grad)
    flagged = [t for t, key in enumerate(keys) if key is None]
    for a, b in zip(flagged, flagged[1:], strict=False):
        if b > a + 1 and all(every[t][0] == "call" for t in range(a + 1, b)):
            keys[a + 1:b] = [None] * (b - a - 1)
    out, j = [], 0
    for token in plain:
        key = _key(plain_trace, token)
        while j < len(keys) and keys[j] != key:
            j += 1
        if j == len(keys):
            return None
        out.append(j)
        j += 1
    return out


def _block_of(label: str, blocks: Sequence[str]) -> int | None:
    for i, block in enumerate(blocks):
        if label == block or label.startswith(block + "."):
            return i
    return None


def _users(trace: _Trace, i: int, blocks: Sequence[str]) -> set[int]:
    """The blocks that could hold the allocation `i` of `trace`: those whose forward made it or ran a call on it."""
    return {_block_of(label, blocks) for label in {trace.info[i]["module"], *trace.uses.get(i, ())}} - {None}


def _runs(trace: _Trace, tokens: list[tuple], matched: set[int], blocks: Sequence[str]) -> list[tuple] | None:
    """The runs of `tokens` (the every-block trace's) not in `matched`: (first, last, block, recomputation), each
    run's block read from its allocations' module labels (a recomputation's from those it tagged `recomputed`), a
    run without allocations the block of the run before it. None where a run names no block or two."""
    runs: list[list] = []
    for t in range(len(tokens)):
        if t in matched:
            continue
        if runs and runs[-1][1] == t - 1:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    out = []
    for first, last in runs:
        allocs = [i for kind, i in tokens[first:last + 1] if kind == "alloc"]
        again = [i for i in allocs if trace.info[i].get("recomputed")]
        named = {_block_of(trace.info[i]["module"], blocks) for i in (again or allocs)}
        if not allocs and out:
            named = {out[-1][2]}
        if len(named) != 1 or None in named:
            return None
        out.append((first, last, named.pop(), bool(again)))
    return out


def _regions(runs: list[tuple], end: int) -> list[tuple[int, int, int]]:
    """Each checkpointed block's backward in the every-block trace: (first token, token after the last, block), from
    its recomputation's first run to the next block's, the last one's to `end` (the optimizer's step)."""
    starts = []
    for first, _, block, again in runs:
        if again and (not starts or starts[-1][1] != block):
            starts.append((first, block))
    return [(t, starts[k + 1][0] if k + 1 < len(starts) else end, block) for k, (t, block) in enumerate(starts)]


def compose(plain: _Trace, every: _Trace, blocks: Sequence[str], chosen: Collection[int]) -> _Trace | None:
    """The one-step trace of the program with the blocks `chosen` (indices into `blocks`, the module labels of
    `advisor.blocks.find_blocks`) checkpointed, from `plain` (no checkpoints) and `every` (every block checkpointed),
    both one-step traces at one batch; None where it cannot be made (see the module docstring)."""
    if any("step2" in t.marks or t.spliced or t.composed or t.repeats is not None for t in (plain, every)) or \
            plain.spec != every.spec or not plain.keys or not every.keys:
        return None
    read_p, read_e = _stream(plain), _stream(every)
    if read_p is None or read_e is None:
        return None
    (p_tokens, p_freed), (tokens, e_freed) = read_p, read_e
    where = _aligned(p_tokens, tokens, plain, every)
    runs = None if where is None else _runs(every, tokens, set(where), blocks)
    if runs is None or any(tokens[t][0] in ("point", "mark") for first, last, _, _ in runs
                           for t in range(first, last + 1)):
        return None
    chosen = set(chosen)
    kept = np.ones(len(tokens), dtype=bool)
    for first, last, block, _ in runs:
        kept[first:last + 1] = block in chosen
    step = next((t for t, (kind, i) in enumerate(tokens) if kind == "point" and every.points[i][0] == "step"),
                len(tokens))
    regions = _regions(runs, step)
    backward = regions[0][0] if regions else step

    def region(at: int) -> int | None:
        return next((block for first, end, block in regions if first <= at < end), None)

    plain_of = {tokens[where[k]][1]: i for k, (kind, i) in enumerate(p_tokens) if kind == "alloc"}
    # where each checkpoint lets go of what it holds: where the every-block trace frees its own allocations (the CPU
    # generator's state it keeps)
    released = {block: max(e_freed.get(i, _NEVER) for kind, i in tokens[first:last + 1] if kind == "alloc")
                for first, last, block, again in runs if not again and first < backward}

    def runs_in(source: str, block: int | None) -> bool:  # the holder of a free in `source` runs in the placement
        return block is None or (block in chosen) == (source == "every")

    def free_of(i: int) -> int | None:
        """Where the allocation `i` of `every` dies in the placement (a token of `every`), None where undecided."""
        at_every = e_freed.get(i, _NEVER)
        if i not in plain_of:
            return at_every
        at_plain = p_freed.get(plain_of[i], _NEVER)
        at_plain = where[at_plain] if 0 <= at_plain < _NEVER else at_plain
        if at_plain == at_every:
            return at_every
        held = _users(every, i, blocks)
        if not held or not {region(at_plain), region(at_every)} <= held | {None}:
            return None  # let go in the backward of a block that did not use it: held through an object (a cache)
        if held <= chosen or not held & chosen:
            return at_every if held <= chosen else at_plain
        (early, early_src), (late, late_src) = sorted([(at_plain, "plain"), (at_every, "every")])
        holder = region(late) if late < _NEVER else _block_of(every.info[i]["name"] or "", blocks)
        if holder is not None and runs_in(late_src, holder):
            return late
        if early_src == "plain" and early < backward:  # no autograd holds it: the checkpoints that run do
            inputs = held & chosen - {_block_of(every.info[i]["module"], blocks)}
            return max([early, *(released[b] for b in inputs)]) if inputs <= set(released) else None
        if early == _NEVER or not runs_in(early_src, region(early)):
            return None
        hidden = [b for first, end, b in regions
                  if b in held and runs_in(late_src, b) and first <= late and end > early]
        return None if hidden else early

    # where each kept token lands: the last kept token at or before each token of `every`
    landed = np.maximum.accumulate(np.where(kept, np.arange(len(tokens)), -1))
    dies: dict[int, list[int]] = {}
    for t, (kind, i) in enumerate(tokens):
        if kind == "alloc" and kept[t]:
            at = free_of(i)
            if at is None:
                return None
            if at < 0:
                return None  # freed before anything was made: not a trace this reads
            if at < _NEVER:
                dies.setdefault(int(landed[at]), []).append(i)
    owner = {t: block for first, last, block, _ in runs for t in range(first, last + 1)}
    return _emit(plain, every, tokens, kept, dies, plain_of, owner, blocks, chosen)


def _tags(plain: dict, every: dict, blocks: Sequence[str], chosen: set[int], users: set[int]) -> dict | None:
    """The tags (`_Tracker.tag`) of an allocation of both traces in the placement: the first block to save it for
    backward tags it (`_Tracker.pack`), by autograd in the plain program, as a checkpoint's input in the every-block
    program. None where a block that saves it in the placement (one of its `users`) may be hidden behind the first each
    trace shows."""
    tags = ("zone", "kind", "name")
    if all(plain[k] == every[k] for k in tags):
        return {}
    first = {}  # trace -> (its first saver, whether that saves in the placement)
    for row, checkpointed in ((plain, False), (every, True)):
        if row["kind"] == "activation":
            block = _block_of(row["name"].rpartition(":")[0], blocks)
            if block is None:
                return None  # saved outside the blocks, in every program alike
            first[checkpointed] = (block, (block in chosen) == checkpointed)
    saving = [(block, checkpointed) for checkpointed, (block, runs) in first.items() if runs]
    shown = min(saving, default=(len(blocks), False))
    for checkpointed, (block, runs) in first.items():
        if not runs and any(block < user < shown[0] and (user in chosen) == checkpointed for user in users):
            return None
    return {k: (every if shown[1] else plain)[k] if saving else None for k in tags}


def _emit(plain: _Trace, every: _Trace, tokens: list[tuple], kept: np.ndarray, dies: dict[int, list[int]],
          plain_of: dict[int, int], owner: dict[int, int], blocks: Sequence[str], chosen: set[int]) -> _Trace | None:
    """The placement's trace: `every`'s kept tokens in order, each allocation's free after the token `dies` names;
    an allocation of both traces with the plain one's tags, or, where autograd saved it in the plain program inside a
    checkpointed block, the every-block one's."""
    # the module label a block's recomputation leaves to what follows it (see the module docstring)
    again = {t for t, (kind, i) in enumerate(tokens) if kind == "alloc" and every.info[i]["call"] in every.recomputing}
    left: dict[int, str] = {}
    last = None
    for t, (kind, i) in enumerate(tokens):
        if t in again:
            last = owner[t]
        elif kind == "alloc" and last is not None:
            left.setdefault(last, every.info[i]["module"])
    sizes, info, events, calls, keys, points, ids = [], [], [], [], [], [], {}
    # `current`: the block whose recomputation left the label (None: none since the phase began); `base`: the plain
    # trace's label of the last allocation of both; `pending`: the block recomputing now, whose label is left once it
    # is over (within it, what none of its modules made has the label of before it)
    marks, call_marks, current, pending, base = {}, {}, None, None, ""
    plain_labels = {point[:2]: point[4] for point in plain.points}  # each point's label in the plain trace

    def label(own: str) -> str | None:
        return own if current is None else left.get(current)

    for t, (kind, i) in enumerate(tokens):
        if not kept[t]:
            continue
        if t not in again and kind != "call" and pending is not None:
            current, pending = pending, None
        if kind == "mark":
            marks[i], call_marks[i], current, pending = len(events), len(calls), None, None
        elif kind == "call":
            calls.append((every.calls[i][0], len(events)))
            keys.append(every.keys[i])
        elif kind == "point":
            at = len(events)
            while at and events[at - 1] < 0:
                at -= 1
            points.append((*every.points[i][:2], len(events), len(calls), label(plain_labels[every.points[i][:2]]),
                           frozenset(events[at:])))
        else:
            row = dict(every.info[i]) if i not in plain_of else dict(plain.info[plain_of[i]])
            if i in plain_of:
                tags = _tags(row, every.info[i], blocks, chosen, _users(every, i, blocks))
                if tags is None:
                    return None
                row.update(tags)
            if t in again:
                pending = owner[t]
                if _block_of(row["module"], blocks) != owner[t]:  # made outside the block's modules
                    row["module"] = label(base)
            else:
                base = row["module"] if i in plain_of else base
                row["module"] = label(row["module"])
            if row["module"] is None:
                return None
            row["call"] = len(calls)
            ids[i] = len(sizes)
            sizes.append(int(every.sizes[i]))
            info.append(row)
            events.append(ids[i])
        events += [-ids[x] - 1 for x in dies.get(t, [])]
    sources, every_of = {}, {p: e for e, p in plain_of.items()}
    for i, own in ids.items():
        copied = every_of.get(plain.sources.get(plain_of[i])) if i in plain_of else every.sources.get(i)
        if (plain.sources.get(plain_of[i]) if i in plain_of else copied) is not None:
            if copied not in ids:
                return None
            sources[own] = ids[copied]
    events = _canonical_frees(events, marks.values())
    return _Trace(np.asarray(sizes, dtype=np.int64), info, np.asarray(events, dtype=np.int64), marks, plain.spec,
                  _signature(events, info), calls, call_marks, keys, sources, points=points, composed=True)
