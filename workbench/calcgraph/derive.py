"""Each allocation's size as a function of the batch: fitted from traces at two batch sizes, or, for a variant
of a program already fitted, borrowed from it so that the variant is traced once (issue 45).

CalcGraph ("CalcGraph: taming the high costs of deep learning using models", 2022, Sections 3.2 and 4.3) compiles
a training program once and answers any batch by arithmetic. A plan here is one trace per allocation size
`a + b * batch`: two traces give `a` and `b`, a third checks them (`fit`), or, where the plan is calibrated
anyway, the real runs at other batches do (`Calibration.line_held`, the advisor's `Plans`).

A variant of a program (the same model and optimizer with step in backward or activation checkpoints) runs the
same kernels on the same shapes in another order, and a checkpoint's recomputation runs the forward's kernels
again. Traced once, at the batch its program was fitted at, each of its allocations takes the slope of the
program's allocations made at the same place (the op, its arguments' shapes and dtypes, its order among the
call's allocations) with the same size (`borrowed_slopes`). What that cannot place is refused, and the variant is
traced at a second batch as before: a place the program never had, or one whose allocations grow differently
(two tensors of one shape at the traced batch but not at others). Two kinds of the checkpoints' own allocations
are placed without the program: the CPU generator's state (`measure.cpu_rng_state_as_op`, a constant size) and a
clone of a tensor of this trace (the state of a BatchNorm's buffers a checkpoint keeps), which grows as what it
copies.

A program's second training step is likewise its first made again, less what the first made to keep (the
optimizer's state): where a two-step trace of the program shows so (`repeat_rule`), its other traces run one step and
the second is made from it (`repeat_step`).

A program with step in backward runs the forward and backward of the same program without it, and updates each
parameter where its gradient becomes ready (`workbench.optim.step_in_backward`'s hook), freeing the gradient there,
with no optimizer step after. Its trace is made from a trace of that program, which notes where each gradient became
ready (`_Tracker.point`), and the updates alone traced one after another (`program.parameter_steps`): each spliced in
at its point (`in_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from .calibrate import _Observed, _places, observe
from .forked import trace_program
from .tracker import _canonical_frees, _signature, _Trace

__all__: list[str] = []  # used through CompiledGraph


def fit(traced: Callable[[int], _Trace], sizes: Sequence[int]) -> tuple[bool, np.ndarray, np.ndarray, list[dict]]:
    """(affine, slope, intercept, rows) of the traces at `sizes` (the first two fit, the rest check): `rows` name
    each allocation a check found off the line, or a check whose allocation sequence differs."""
    (s1, s2), checks = sizes[:2], sizes[2:]
    t1, t2 = traced(s1), traced(s2)
    if t1.signature != t2.signature:
        return False, np.zeros(0, np.int64), np.zeros(0, np.int64), []
    slope = (t2.sizes - t1.sizes) // (s2 - s1)
    intercept = t1.sizes - slope * s1
    exact = (t2.sizes - t1.sizes) % (s2 - s1) == 0
    rows = []
    for s in checks:
        t = traced(s)
        if t.signature != t1.signature:
            rows.append({"size": s, "allocation": -1, "op": "sequence differs", "predicted": -1, "traced": -1})
            continue
        bad = np.nonzero((intercept + slope * s != t.sizes) | ~exact)[0]
        rows += [{"size": s, "allocation": int(i), "op": t.info[i]["op"],
                  "predicted": int(intercept[i] + slope[i] * s), "traced": int(t.sizes[i])} for i in bad]
    return not rows, slope, intercept, rows


def _rng_state_place() -> tuple:
    # the stand-in `cpu_rng_state_as_op` makes under fake tensors: `torch.empty(size, dtype=torch.uint8)`
    return ("empty.memory_format", ((torch.default_generator.get_state().numel(),),)), 0


def borrowed_slopes(trace: _Trace, reference: _Trace, reference_slope: np.ndarray) -> np.ndarray | None:
    """Each allocation's slope in `trace` (a variant traced at `reference`'s batch), or None where one cannot be
    placed (see the module docstring)."""
    known: dict[tuple, set[int]] = {}
    for i, place in enumerate(_places(reference)):
        known.setdefault((place, int(reference.sizes[i])), set()).add(int(reference_slope[i]))
    rng_state = _rng_state_place()
    slopes = np.zeros(len(trace.sizes), dtype=np.int64)
    for i, place in enumerate(_places(trace)):
        found = known.get((place, int(trace.sizes[i])), ())
        source = trace.sources.get(i)
        if len(found) == 1:
            slopes[i] = next(iter(found))
        elif found:  # allocations of one place and size that grow differently: which is this one?
            return None
        elif place == rng_state:
            slopes[i] = 0
        elif source is not None and trace.sizes[source] == trace.sizes[i]:  # a whole copy grows as its original
            slopes[i] = slopes[source]
        else:
            return None
    return slopes


def _replay(trace: _Trace, stop: str, renewed: bool) -> tuple | None:
    """Step 1 of `trace` made again as step 2, right after its mark `stop` ("step2" of a two-step trace, "end" of a
    one-step one): (sizes, info, events, calls, keys, sources, swapped, repeats) of the new step, its allocations
    numbered on from those made before `stop`, its calls' event positions counted from `stop`; `swapped` maps each of
    step 1's allocations that step 2 frees to its new one, `repeats` names the call of step 1 each call repeats. None
    where `trace` allocates after `stop`.

    What step 1 made and kept past `stop` is not made again (the optimizer's state and step counters), nor is
    anything else the calls that made it allocated; a free of what step 1 did not make is not repeated. With
    `renewed`, what it kept untagged (not the optimizer's state: a cache of the step's coefficients) is made again
    instead, step 1's freed right after.
    """
    events, (s, e), (cs, ce) = trace.events, (trace.marks["step1"], trace.marks[stop]), \
        (trace.call_marks["step1"], trace.call_marks[stop])
    base = int((events[:e] >= 0).sum())  # allocations made before `stop`
    if stop == "end" and base != len(trace.sizes):
        return None
    _, died = trace.lifetimes()
    made = [int(i) for i in events[s:e] if i >= 0]
    kept = [i for i in made if died[i] >= e]
    swapped = {i for i in kept if renewed and trace.info[i]["kind"] is None}
    once = {trace.info[i]["call"] for i in kept if i not in swapped}  # the calls that made what outlives step 1
    again = [i for i in made if trace.info[i]["call"] not in once]
    ids = {old: base + n for n, old in enumerate(again)}
    calls = [c for c in range(cs, ce) if c not in once]
    call_ids = {old: ce + n for n, old in enumerate(calls)}
    out, before = [], np.zeros(e - s + 1, dtype=np.int64)  # the new step's events before each of step 1's
    for k, ev in enumerate(events[s:e]):
        before[k] = len(out)
        old = int(ev) if ev >= 0 else int(-ev - 1)
        if old in ids:
            out.append(ids[old] if ev >= 0 else -ids[old] - 1)
        if ev >= 0 and old in swapped:  # step 1's copy, freed once the call that made the new one returned
            out.append(-old - 1)
    before[-1] = len(out)
    swapping = {trace.info[i]["call"] for i in swapped}
    info = [dict(trace.info[old], phase="step2", call=call_ids.get(trace.info[old]["call"], -1)) for old in again]
    return ([int(trace.sizes[old]) for old in again], info, _canonical_frees(out),
            [(trace.calls[c][0], e + int(before[trace.calls[c][1] - s]) - (c in swapping)) for c in calls],
            [trace.keys[c] for c in calls] if trace.keys else [],
            {ids[i]: ids.get(src, src) for i, src in trace.sources.items() if i in ids},
            {old: ids[old] for old in swapped}, calls)


def repeat_step(trace: _Trace, renewed: bool) -> _Trace | None:
    """The two-step trace of a program traced for one step (build, step 1): step 2 is step 1 made again (`_replay`,
    `renewed` as `repeat_rule` found it for this program), the program's last frees (its model, its optimizer's
    state) after it. None where `_replay` cannot make it.

    # NOTE: a step made again makes the same calls on the same shapes as the first, less the state: tracing one step
    # and not two leaves out a third of a trace's op calls, each through FakeTensor's dispatch (issue 45)
    """
    step = _replay(trace, "end", renewed)
    if step is None:
        return None
    sizes, info, new, calls, keys, sources, swapped, repeats = step
    (e, ce), n = (trace.marks["end"], trace.call_marks["end"]), len(new)
    last = _canonical_frees([-swapped.get(-v - 1, -v - 1) - 1 for v in trace.events[e:]])  # frees alone
    events = np.asarray([*trace.events[:e], *new, *last], dtype=np.int64)
    marks = {**{k: v for k, v in trace.marks.items() if k != "end"}, "step2": e, "end": e + n}
    call_marks = {**{k: v for k, v in trace.call_marks.items() if k != "end"}, "step2": ce, "end": ce + len(calls)}
    all_info = trace.info + info
    return _Trace(np.concatenate([trace.sizes, np.asarray(sizes, dtype=np.int64)]), all_info, events, marks,
                  trace.spec, _signature(events, all_info),
                  trace.calls[:ce] + calls + [(op, at + n) for op, at in trace.calls[ce:]], call_marks,
                  trace.keys[:ce] + keys + trace.keys[ce:], {**trace.sources, **sources}, repeats,
                  spliced=trace.spliced, composed=trace.composed)


def repeat_rule(trace: _Trace) -> bool | None:
    """How step 2 of the two-step `trace` is its step 1 made again: `_replay`'s `renewed`, False or True, the first
    that makes it allocation by allocation and call by call; None where neither does (the program is then traced for
    both steps)."""
    if "step2" not in trace.marks or any(v >= 0 for v in trace.events[trace.marks["end"]:]):
        return None
    (s, e), (cs, ce) = (trace.marks["step2"], trace.marks["end"]), (trace.call_marks["step2"], trace.call_marks["end"])
    base = int((trace.events[:s] >= 0).sum())
    for renewed in (False, True):
        sizes, info, events, calls, keys, sources, _, _ = _replay(trace, "step2", renewed)
        ids = range(base, base + len(sizes))
        if (events == trace.events[s:e].tolist() and sizes == trace.sizes[base:base + len(sizes)].tolist()
                and info == trace.info[base:base + len(sizes)] and calls == trace.calls[cs:ce]
                and keys == trace.keys[cs:ce] and sources == {i: trace.sources[i] for i in ids if i in trace.sources}):
            return renewed
    return None


_UNKNOWN = "unknown"  # `StepTracer.renewed` before a two-step trace shows it


class StepTracer:
    """A training program's tracer: at each batch its build and first step alone (`one_step`), the second made from
    them (`repeat_step`), where a two-step trace of it showed how (`repeat_rule`: its first trace, or one of a program
    `like` it, the same model and optimizer); else both steps (and where `one_step` is None). `made`: traces made
    already, batch -> trace: the one-step ones are used once the rule is known, and kept with those traced here
    (`first_steps`: what a program with step in backward is made from, the advisor's `Plans`)."""

    def __init__(self, program: Callable, one_step: Callable | None, device: torch.device,
                 like: StepTracer | None = None, made: Mapping[int, _Trace] | None = None) -> None:
        self.program, self.one_step, self.device = program, one_step, device
        self.renewed: bool | str | None = None if one_step is None else like.renewed if like is not None else _UNKNOWN
        self.first_steps = {s: t for s, t in (made or {}).items() if "step2" not in t.marks}
        self.real_rule: bool | None = None  # `repeat_rule` of calibration's first real run (`observe`)
        both = [t for s, t in (made or {}).items() if s not in self.first_steps]
        if self.renewed is _UNKNOWN and both:
            self.renewed = repeat_rule(both[0])

    def observe(self, sizes: Sequence[int]) -> dict[int, _Observed | str]:
        """Calibration's real runs at `sizes` (`calibrate.observe`): the first of both steps, the others of the
        first step alone, the second made from it, where the first real run's second step is its first made again as
        the traces' is (`repeat_rule`): the same allocations and calls, each call's scratch the one it repeats took.
        Such a run's `peak` is its first step's (calibration's fit does not read it; its checks run both steps).

        # NOTE: a real step costs calibration as much as a traced one costs the plan (its op calls marked for the
        # profiler, its allocator's events read): DenseNet-BC-100's three runs at 2, 4 and 8 took 1.1-1.8 s, those
        # of one step 0.9 s
        """
        out: dict[int, _Observed | str] = {}
        for size in map(int, sizes):
            if out and isinstance(self.renewed, bool) and self.real_rule == self.renewed:
                run = observe(self.one_step, size, self.device)
                made = None if isinstance(run, str) else repeat_step(run.trace, self.renewed)
                if made is not None:
                    ce = run.trace.call_marks["end"]
                    scratch = np.concatenate([run.scratch[:ce], run.scratch[made.repeats], run.scratch[ce:]])
                    out[size] = _Observed(made, scratch, run.peak)
                    continue
            out[size] = observe(self.program, size, self.device)
            if len(out) == 1:
                self.real_rule = None if isinstance(out[size], str) else repeat_rule(out[size].trace)
        return out

    def __call__(self, size: int) -> _Trace:
        if self.renewed is None:
            return trace_program(self.program, size, self.device)
        if self.renewed is _UNKNOWN:
            trace = trace_program(self.program, size, self.device)
            self.renewed = repeat_rule(trace)
            return trace
        if size not in self.first_steps:
            self.first_steps[size] = trace_program(self.one_step, size, self.device)
        made = repeat_step(self.first_steps[size], self.renewed)
        return made if made is not None else trace_program(self.program, size, self.device)


def _split_bursts(trace: _Trace, points: Sequence[tuple]) -> np.ndarray | None:
    """`trace`'s events with each burst of frees that holds some of `points` ordered so that each point's frees (those
    before it as traced, `_Tracker.point`) come first: canonical order (`_canonical_frees`) had mixed them. None where a
    point's frees are not its burst's."""
    events = trace.events.copy()
    bursts: dict[int, list[tuple]] = {}
    for point in points:
        start = point[2]
        while start > 0 and events[start - 1] < 0:
            start -= 1
        bursts.setdefault(start, []).append(point)
    for start, inside in bursts.items():
        end = start
        while end < len(events) and events[end] < 0:
            end += 1
        burst, order = set(events[start:end].tolist()), []
        for point in sorted(inside, key=lambda p: p[2]):
            order += sorted(point[5] - set(order))
            if not point[5] <= burst or len(order) != point[2] - start:
                return None
        events[start:end] = order + sorted(burst - set(order))
    return events


def _tokens(trace: _Trace, events: np.ndarray, stops: Sequence[tuple[int, int]], source: str):
    """`trace`'s events and calls in the order they happened, cut at each (event, call) of `stops`: a list per span
    before each stop, each token ("call", source, index) or ("event", source, event). None where a stop is not between
    two calls."""
    spans, e, c, out = [], 0, 0, []
    for stop_e, stop_c in stops:
        while e < stop_e or c < stop_c:
            if c < stop_c and trace.calls[c][1] <= e:
                out.append(("call", source, c))
                c += 1
            elif e < stop_e:
                out.append(("event", source, int(events[e])))
                e += 1
            else:
                return None
        spans.append(out)
        out = []
    return spans


def in_backward(base: _Trace, steps: _Trace) -> _Trace | None:
    """The one-step trace of `base`'s program (traced for one step without step in backward) with step in backward:
    each parameter's update, as `steps` traced it (`program.parameter_steps`, in the order `base`'s gradients became
    ready), spliced in where its gradient became ready, its gradient freed there, and the optimizer's step and what it
    made left out. None where that cannot be made (then the program is traced).

    # NOTE: the same backward runs, and the hook that updates a parameter runs where its gradient is ready
    # (`workbench.optim.step_in_backward`): only the updates are traced, not the forward and backward again (issue 45)
    """
    ready = [p for p in base.points if p[0] == "ready"]
    stepped = [p for p in base.points if p[0] == "step"]
    begins = [p for p in steps.points if p[0] == "ready"]
    ends = [p for p in steps.points if p[0] == "applied"]
    if not ready or "step2" in base.marks or len(stepped) != 1 or len(ends) != len(begins) or \
            [p[1] for p in ready] != [p[1] for p in begins] or base.spec["parameters"] != steps.spec["parameters"]:
        return None
    end_e, step_e = base.marks["end"], stepped[0][2]
    born, died = base.lifetimes()
    grads = {info["name"][:-len(".grad")]: i for i, info in enumerate(base.info)
             if info["kind"] == "gradient" and info["phase"] == "step1"}
    if any(p[1] not in grads or not born[grads[p[1]]] < p[2] or not step_e <= died[grads[p[1]]] < end_e
           for p in ready):
        return None  # a gradient that is not the parameter's alone, freed by the optimizer's zero_grad
    base_events, step_events = _split_bursts(base, [*ready, *stepped]), _split_bursts(steps, steps.points)
    if base_events is None or step_events is None:
        return None
    spans = _tokens(base, base_events, [p[2:4] for p in ready] + [stepped[0][2:4]], "base")
    # each update between its two points, then what follows the last (the closing frees)
    pieces = _tokens(steps, step_events, [q for b, a in zip(begins, ends, strict=True) for q in (b[2:4], a[2:4])]
                     + [(len(steps.events), len(steps.calls))], "steps")
    if spans is None or pieces is None:
        return None
    # what a piece refers to outside it: its gradient's stand-in (the allocation just before it), the parameters
    stand_ins = [int(steps.events[b[2] - 1]) for b in begins]
    between = [t for piece in pieces[2:-1:2] for t in piece if t[0] == "event" and t[2] < 0]
    freed = {-e - 1 for piece in pieces[1::2] for kind, _, e in piece if kind == "event" and e < 0}
    if min(stand_ins) < 0 or between or not freed.issuperset(stand_ins):  # a free of neither update; a gradient kept
        return None
    outside = {i: grads[b[1]] for i, b in zip(stand_ins, begins, strict=True)}
    params = {info["name"]: i for i, info in enumerate(base.info) if info["kind"] == "parameter"}
    outside.update({i: params[info["name"]] for i, info in enumerate(steps.info)
                    if info["kind"] == "parameter" and info["name"] in params})
    tokens = spans[0]
    for k, point in enumerate(ready):
        tokens += [(*t, point[4]) for t in pieces[2 * k + 1]] + spans[k + 1]
    made = {int(e) for piece in pieces[1::2] for kind, _, e in piece if kind == "event" and e >= 0}
    applied = {grads[p[1]] for p in ready}
    closing = pieces[-1]
    # after the backward: the frees of what it made (not the updated gradients, freed as each update ended)
    tail = [("event", "base", int(e)) for e in base_events[step_e:end_e]
            if e < 0 and born[-e - 1] < step_e and -e - 1 not in applied]
    last = [("event", "base", int(e)) for e in base_events[end_e:] if e < 0 and born[-e - 1] < step_e] \
        + [t for t in closing if t[0] == "event" and t[2] < 0 and -t[2] - 1 in made]
    sizes, info, events, calls, keys, ids = [], [], [], [], [], {}
    marks, call_marks = {"step1": base.marks["step1"]}, {"step1": base.call_marks["step1"]}
    for part in (tokens + tail, last):
        if part is last:
            marks["end"], call_marks["end"] = len(events), len(calls)
        for kind, source, value, *module in part:
            trace = base if source == "base" else steps
            if kind == "call":
                calls.append((trace.calls[value][0], len(events)))
                keys.append(trace.keys[value] if trace.keys else None)
            elif value >= 0:
                ids[source, value] = len(sizes)
                row = dict(trace.info[value], call=len(calls))
                if source == "steps":
                    row.update(module=module[0], phase="step1")
                elif value in applied:
                    row.update(zone=None, kind=None, name=None)  # no `tag_grads`: the update freed it
                sizes.append(int(trace.sizes[value]))
                info.append(row)
                events.append(ids[source, value])
            else:
                old = -value - 1
                key = ("base", outside[old]) if source == "steps" and old in outside else (source, old)
                if key not in ids:
                    return None
                events.append(-ids[key] - 1)
    sources = {}
    for source, trace in (("base", base), ("steps", steps)):
        for i, copied in trace.sources.items():
            key = ("base", outside[copied]) if source == "steps" and copied in outside else (source, copied)
            if (source, i) in ids and key not in ids:
                return None
            if (source, i) in ids:
                sources[ids[source, i]] = ids[key]
    events = _canonical_frees(events, marks.values())
    return _Trace(np.asarray(sizes, dtype=np.int64), info, np.asarray(events, dtype=np.int64), marks, base.spec,
                  _signature(events, info), calls, call_marks, keys if base.keys else [], sources, spliced=True)
