"""The advisor's memory side: one CalcGraph plan ("CalcGraph: taming the high costs of deep learning using
models", 2022, Section 3.2: the training program traced under fake tensors, sizes affine in the batch) per
distinct training program, shared by every candidate that runs it, calibrated once per precision.

Shared programs: bf16 weights with any packed width k and either state dtype run the same forward, backward
and update (one kernel call per parameter) and differ only in the optimizer state's size. That state is live
through the whole steady-state step, where the peak is, so such a candidate's plan is its program's plus the
difference in state bytes, counted on the optimizer's state built for the model on the meta device (no
memory, no op). Measured against tracing each variant: equal to the byte at batches 8 and 64 for the suite's
MLP and ResNet-50, with and without step in backward and checkpoints (24 programs, 4 traced instead). An
optimal checkpoint plan that checkpoints nothing runs the plain program; one equal to the uniform plan, the
uniform program.

Calibration (CPU): the kernels' scratch that fake tensors cannot see (and tensors larger than their fake
size), measured once per precision in real steps at batches 2, 4 and 8 (1, 2 and 4 for a batch of 1) of its
plain program (`CompiledGraph.calibrate`), and carried over call by call to every other program of that
precision (`CompiledGraph.calibrated_like`): each op call takes the scratch measured for the same op on the
same shapes, so a checkpoint's recomputation and a backward whose peak lies elsewhere count the scratch of
the kernel that runs there. (A plain program's correction added at every candidate's peak missed a
DenseNet-BC with uniform block checkpoints by -10.2%, -5.6% with step in backward: at 2 threads the peak of
its checkpointed step is beside oneDNN's convolution backward scratch.) On the CPU the same real runs check the
plain program's line, fitted from traces at batches 2 and 3, in place of a third trace (`Calibration.line_held`; a
trace at batch 4 where they do not show it). Every trace but each precision's first runs one training step, the second
made from it (`CompiledGraph`'s `one_step`, `calcgraph.derive.repeat_step`) as that first two-step trace shows it may;
so does every real run of calibration but the first, where that first one shows it may too (`StepTracer.observe`).
A program with step in backward is not traced where its program without it was traced in the same worker, or on the
CPU in this process: it is made from that trace and its optimizer's updates alone, traced once per precision
(`_spliced`, `calcgraph.derive.in_backward`; equal to its own trace on the suite's four models in every precision, with
and without checkpoints). On the CPU a checkpoint placement over a model's blocks is not traced either where its plain
and every-block programs were made here: it is composed from their traces (`_compose`, `calcgraph.placements`).
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Sequence
from dataclasses import replace

from workbench.calcgraph import CompiledGraph
from workbench.calcgraph.calibrate import NoAllocatorEvents, unaligned_probe
from workbench.calcgraph.derive import in_backward
from workbench.calcgraph.forked import keep_traced, run_forked, trace_program, traced_at
from workbench.calcgraph.placements import compose

from .configs import Config, block_labels
from .plan import CATEGORIES, Plan
from .workload import Workload

__all__ = ["CATEGORIES", "Plan", "Plans"]

def _compile(work: Workload, cfg: Config, segments: Sequence | None, sizes: tuple[int, ...] = (2, 3, 4),
             like: CompiledGraph | None = None, traced: dict[int, object] | None = None) -> CompiledGraph:
    """CalcGraph's plan of a candidate's program traced at batch `sizes` (`Plans._trace_sizes`), its first step alone
    traced where its second is the first made again (`CompiledGraph`'s `one_step`; not for a sharded program).
    `traced`: its traces made already, batch -> trace (`_trace_program`)."""
    one_step = work.program(cfg, segments=segments, steps=1) if work.world_size == 1 else None
    return CompiledGraph(work.program(cfg, segments=segments), device=work.device, trace_sizes=sizes,
                         input_shape=tuple(work.inputs.shape[1:]), description=cfg.name, like=like, traced=traced,
                         one_step=one_step)


def _plain(key: tuple) -> tuple:
    """The plain program (no step in backward, no checkpoints) of the program `key` (`Plans._key`)."""
    return replace(key[0], step_in_backward=False, checkpoint="none"), None


def _without_step(key: tuple) -> tuple:
    """The program `key` (`Plans._key`) without step in backward."""
    return replace(key[0], step_in_backward=False), key[1]


def _ends(key: tuple) -> list[tuple]:
    """The plain and every-block programs of the checkpoint placement `key`, from which it is composed."""
    return [(replace(key[0], checkpoint=kind), None) for kind in ("none", "uniform")]


def _trace_program(work: Workload, key: tuple, size: int, steps: int) -> object:
    """The program `key` (`Plans._key`) traced at batch `size` for `steps` steps (`_compile`'s graph makes a
    two-step trace of a one-step one)."""
    return trace_program(work.program(key[0], segments=key[1], steps=steps), size, work.device)


def _trace_group(work: Workload, jobs: Sequence[tuple[tuple, int]], size: int) -> tuple[list, dict]:
    """`_trace_program` of each (key, steps) of `jobs` at batch `size` in turn, None for one that failed (its caller
    traces it again itself and meets the error there); a program with step in backward whose program without it was
    traced before it here is made from that trace (`_spliced`). And the optimizer's updates traced for that."""
    out, traced, updates = [], {}, {}
    for key, steps in jobs:
        try:
            made = _spliced(work, key, traced, updates, size) if steps == 1 else None
            out.append(made if made is not None else _trace_program(work, key, size, steps))
        except Exception:  # noqa: BLE001 - see the docstring
            out.append(None)
        traced[key] = out[-1]
    return out, updates


def _spliced(work: Workload, key: tuple, traced: dict, updates: dict, size: int) -> object | None:
    """The one-step trace of the program `key` with step in backward, made from its program without it in `traced`
    and the optimizer's updates alone (`calcgraph.derive.in_backward`), traced once for every program whose gradients
    become ready in the same order (`updates`: a checkpointed program's as a plain one's, measured on the suite's
    four models); None where there is none or it cannot be made."""
    cfg, segments = key
    base = traced.get(_without_step(key)) if cfg.step_in_backward else None
    if base is None or "step2" in base.marks:
        return None
    order = tuple(point[1] for point in base.points if point[0] == "ready")
    try:
        if order not in updates:
            updates[order] = trace_program(work.parameter_steps(cfg, base.spec["parameters"], order), size,
                                           work.device)
        return in_backward(base, updates[order])
    except Exception:  # noqa: BLE001 - a trace it could not make is traced
        return None


def _unmade_at_one(graphs) -> dict[int, CompiledGraph]:
    """Of affine `graphs`, those whose batch 1 is neither traced nor decided, each once: a calibrated view shares its
    traces with its program (by the id of those)."""
    return {id(g._exact): g for g in graphs if g.affine and not hasattr(g, "_one") and 1 not in g._exact}


class Plans:
    """Every candidate's `Plan`, each distinct program traced once (see the module docstring)."""

    def __init__(self, work: Workload, grid: Sequence[Config], *, uniform: Sequence | None = None,
                 checked_by_calibration: bool = False) -> None:
        self.work = work
        # each precision's plain program is fitted at batches 2 and 3 and its line checked by its calibration's real
        # runs (`calibrate`), else by a trace at batch 4 once a plan is asked for (`check_lines`)
        self.checked_by_calibration = checked_by_calibration
        self._unchecked: dict[tuple, None] = {}  # plain programs whose line is still to be checked, in order
        self.uniform = None if uniform is None else list(uniform)  # the uniform checkpoint plan's segments
        packed = [c for c in grid if c.precision == "bf16"]
        # the packed variant whose program is traced for all of them (sharded: each traced, its state is sharded)
        self._packed = (packed[0].extra_bits, packed[0].state_dtype) if packed and work.world_size == 1 else None
        self._graphs: dict[tuple, CompiledGraph] = {}
        self._ahead: dict[tuple, dict[int, object]] = {}  # program -> its traces made side by side (`trace_ahead`)
        self._updates: dict[Config, dict] = {}  # per precision, its optimizer's updates made here (`_made_here`)
        # per precision, its plain program's plan as traced and as calibrated
        self._calibrated: dict[str, tuple[CompiledGraph, CompiledGraph]] = {}
        self.no_allocator_events = False  # calibration found none of the device allocator's events: not retried
        self._views: dict[int, CompiledGraph] = {}  # each traced plan with its precision's calibration carried over
        self._states: dict[tuple, int] = {}
        self._peaks: dict[tuple, int] = {}  # every plan's program peaks (`Plan.memo`)

    def _key(self, cfg: Config, segments: Sequence | None) -> tuple[Config, tuple | None]:
        """The program `cfg` runs with `segments`: its traced representative config and plan."""
        rep = replace(cfg, extra_bits=self._packed[0], state_dtype=self._packed[1]) if cfg.precision == "bf16" \
            and self._packed is not None else cfg
        if segments is not None and not any(c for _, _, c in segments):
            return replace(rep, checkpoint="none"), None
        if segments is not None and self.uniform is not None and list(segments) == self.uniform:
            return replace(rep, checkpoint="uniform"), None
        return rep, None if segments is None else tuple(segments)

    def graph(self, cfg: Config, segments: Sequence | None = None) -> CompiledGraph:
        """The traced plan of the program `cfg` runs (traced now if new)."""
        return self._compiled(self._key(cfg, segments))

    def _compiled(self, key: tuple) -> CompiledGraph:
        """The plan of the program `key` (`_key`): traced now if new, or made from its program without step in
        backward (`_made_here`)."""
        if key not in self._graphs:
            like = None if _plain(key) == key else self._compiled(_plain(key))
            sizes = self._trace_sizes(key)
            self._compose(key)
            made = self._ahead.pop(key, None) or self._made_here(key, sizes[1])
            self._graphs[key] = _compile(self.work, *key, sizes, like, made)
            if like is None and len(sizes) == 2:
                self._unchecked[key] = None
        return self._graphs[key]

    def _made_here(self, key: tuple, size: int) -> dict[int, object] | None:
        """{`size`: the one-step trace of the program `key` with step in backward made here from its program without it
        (`_spliced`)}, where that program's plan was made here (not forked: `trace_ahead` of a single program group, a
        worker that failed, one trace process; or composed, `_compose`); else None (traced).

        # NOTE: CPU programs only, where `in_backward` was compared with the traced program; a CUDA program is traced
        """
        cfg, base = key[0], _without_step(key)
        if not cfg.step_in_backward or self.work.device.type != "cpu" or \
                (base not in self._graphs and base not in self._ahead):
            return None
        first = self._compiled(base)._tracer.first_steps.get(size)
        updates = self._updates.setdefault(replace(cfg, checkpoint="none"), {})
        made = None if first is None else _spliced(self.work, key, {base: first}, updates, size)
        return None if made is None else {size: made}

    def _compose(self, key: tuple) -> None:
        """Make the checkpoint placement that `key` runs without step in backward, where it is over a model's blocks and
        not made yet, from its plain and every-block programs' one-step traces made here (`_composed`), for `_compiled`
        to find; where it cannot be made, it is traced."""
        base = _without_step(key)
        if self._composable(base) and base not in self._graphs and base not in self._ahead and \
                all(e in self._graphs or e in self._ahead for e in _ends(base)):
            size = self._trace_sizes(base)[1]
            made = self._composed(base, size)
            if made is not None:
                self._ahead[base] = {size: made}

    def _composed(self, key: tuple, size: int) -> object | None:
        """The one-step trace at batch `size` of the placement `key` (`_composable`) composed from its plain and
        every-block programs' (`calcgraph.placements.compose`), None where either was not made here for one step at
        `size` or it cannot be made."""
        traces = [self._compiled(end)._tracer.first_steps.get(size) for end in _ends(key)]
        return None if None in traces else compose(*traces, self._blocks, {i for a, b, c in key[1] if c
                                                                           for i in range(a, b)})

    def _composable(self, key: tuple) -> bool:
        """Whether `key` is a checkpoint placement over a model's blocks, without step in backward, on the CPU.

        # NOTE: CPU programs only, where the composition was compared with the traced placements
        """
        return key[1] is not None and not key[0].step_in_backward and self.work.device.type == "cpu" and \
            self.work.world_size == 1 and bool(self._blocks)

    _blocks = functools.cached_property(lambda self: block_labels(self.work.build))  # the model's, where checkpointed

    @property
    def programs(self) -> int:
        """Distinct programs traced."""
        return len(self._graphs)

    def _trace_sizes(self, key: tuple) -> tuple[int, ...]:
        """The batches the program `key` is fitted (and checked) at.

        # NOTE: a precision's plain program is traced at batches 2 and 3 and checked at 4 (CalcGraph's default), or,
        # `checked_by_calibration`, checked by the real runs its calibration takes anyway (`Calibration.line_held`,
        # else at 4 after all: `check_lines`); its variants (step in backward, checkpoints: the same layers, the
        # same shapes) at 3 only, each allocation's growth borrowed from the plain program (`calcgraph.derive`), or
        # at 2 and 3 where that cannot place one, and checked at 4 where the plain program is not affine
        """
        if _plain(key) == key:
            return (2, 3) if self.checked_by_calibration else (2, 3, 4)
        plain = self._graphs.get(_plain(key))
        return (2, 3) if plain is None or plain.affine else (2, 3, 4)

    def check_lines(self) -> None:
        """Check by a trace at batch 4 (`CompiledGraph.check`) the line of each plain program its calibration did not
        show, or that was not calibrated, the traces side by side in forked workers. Off the line, a program is not
        affine: its calibration is dropped and the programs derived from it are compiled again when next asked for."""
        keys = list(self._unchecked)
        self._trace_side_by_side([self._graphs[key] for key in keys], 4)
        for key in keys:
            del self._unchecked[key]
            graph = self._graphs[key]
            if graph.check(4):
                continue
            for other in [k for k in self._graphs if k != key and _plain(k) == key]:
                del self._graphs[other]
            self._calibrated.pop(key[0].precision, None)
            self._views.clear()
            self.forget_peaks()

    def trace_ahead(self, programs: Sequence[tuple[Config, Sequence | None]]) -> None:
        """Trace every program of `programs` (a candidate and its checkpoint segments) not traced yet, side by side in
        forked processes (`calcgraph.forked`): a plain program at its fit's batches, a variant at the batch it is
        derived from (`_compile`). `graph` then finds them made; whatever a worker did not make it traces itself."""
        if self.work.world_size > 1:  # a sharded program runs in a fake process group: not forked
            return
        keys = [k for k in dict.fromkeys(self._key(c, s) for c, s in programs)
                if k not in self._graphs and k not in self._ahead]
        # a checkpoint placement composed here (`_compose`), and its program with step in backward, made from it here
        # (`_made_here`), are not traced
        before = set(self._ahead)
        for key in keys:
            self._compose(key)
        keys = [k for k in keys if _without_step(k) not in set(self._ahead) - before]
        # a variant is first traced at its fit's second batch, the one it is derived at (`CompiledGraph`)
        jobs = [(key, size) for key in keys
                for size in (self._trace_sizes(key) if _plain(key) == key else self._trace_sizes(key)[1:2])]
        if len(jobs) < 2:
            return
        # NOTE: one worker traces every program of a precision at one batch, one after the other: they run the same
        # layers on the same shapes, so each finds most of its op calls in the dispatch cache its predecessors filled
        # in that process (`calcgraph.kernels`), where a program at another batch or precision finds few. Groups go
        # largest first, each to whichever worker is free, and of equal ones a packed precision's first: its
        # optimizer's update per parameter made its groups the longest (DenseNet-BC-100: 2.7 s at batch 3 and 1.7 s at
        # 2, against 1.9-2.0 s and 1.1 s), and starting them last left one worker idle for 1.5 s at the end.
        # Each precision's plain program at its first batch is traced for both steps, every other for its first step
        # alone (`CompiledGraph`'s `one_step`). A program with step in backward follows its program without it, from
        # which it is made (`_spliced`); the updates traced for that come back (for `_made_here`).
        groups: dict[tuple, list] = {}
        for key, size in sorted(jobs, key=lambda job: job[0][0].step_in_backward):
            steps = 2 if _plain(key) == key and size == self._trace_sizes(key)[0] else 1
            groups.setdefault((_plain(key), size), []).append((key, steps))
        order = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0][0][0].precision != "bf16"))
        made = run_forked([functools.partial(_trace_group, self.work, members, size)
                           for (_, size), members in order])
        for ((plain, size), members), results in zip(order, made, strict=True):
            results, updates = results or ([None] * len(members), {})
            self._updates.setdefault(replace(plain[0], step_in_backward=True), {}).update(updates)
            for (key, _), result in zip(members, results, strict=True):
                if result is not None:
                    self._ahead.setdefault(key, {})[size] = result

    def trace_batch_one(self, plans: Sequence[Plan]) -> None:
        """Trace batch 1 side by side in forked workers (`calcgraph.forked`) for the programs of `plans` that will be
        asked for it (`Advice.rebudget`'s largest-batch search) and have not traced it: each plan's program, or, for a
        variant, the program it borrowed its growth from (whose batch 1 decides the variant's,
        `CompiledGraph._batch_one`). Then a variant whose program's batch 1 is off the line runs its own, made here
        where it can be: a checkpoint placement over blocks composed (`_composed`, from its plain and every-block
        programs' batch 1), a program with step in backward spliced from its program without it (`_made_here`; that
        program composed so, or traced). What these are made from is traced side by side with the variants that cannot
        be made (`_batch_one_sources`); whatever a worker did not make, or could not be made, is traced where asked
        for. Where another program of the model had its batch 1 off the line (the same layers: a transformer's), that
        is traced with the programs' batch 1, in one round, not after it."""
        variants = [p.graph for p in plans if p.graph._like is not None]
        first = _unmade_at_one(p.graph._like or p.graph for p in plans)
        if any(getattr(graph, "_one", None) is not None for graph in self._graphs.values()):
            first |= self._batch_one_sources(_unmade_at_one(variants))[2]
        self._trace_side_by_side(first.values())
        own = _unmade_at_one(g for g in variants if g._like._batch_one() is not None)
        placements, spliced, todo = self._batch_one_sources(own)
        self._trace_side_by_side(todo.values())
        for key in placements:
            self._made_at_one(self._graphs[key], self._composed(key, 1))
        for i, key in spliced.items():
            self._made_at_one(own[i], (self._made_here(key, 1) or {}).get(1))

    def _batch_one_sources(self, own: dict) -> tuple[list, dict, dict]:
        """For the variants `own` (`_unmade_at_one`) that run their own batch 1: the placements composed there (their
        fit's batch was composed: one refused there, a cache held whole, is traced), the programs with step in backward
        spliced there (index in `own` -> key), and the graphs to trace at batch 1 for the rest and for what these are
        made from, each once."""
        keys = {id(graph._exact): key for key, graph in self._graphs.items()}
        local = self.work.device.type == "cpu" and self.work.world_size == 1  # where `_made_here` was compared
        spliced = {i: keys[i] for i in own if local and i in keys and keys[i][0].step_in_backward
                   and _without_step(keys[i]) in self._graphs}
        placements = [key for key in dict.fromkeys([*(keys[i] for i in own if i in keys),
                                                    *map(_without_step, spliced.values())])
                      if self._composable(key) and all(e in self._graphs for e in _ends(key)) and
                      getattr(self._graphs[key]._tracer.first_steps.get(self._trace_sizes(key)[1]), "composed", False)]
        sources = [*(e for key in placements for e in _ends(key)),
                   *(b for b in map(_without_step, spliced.values()) if b not in placements)]
        todo = {i: g for i, g in own.items() if i not in spliced and keys.get(i) not in placements}
        return placements, spliced, todo | _unmade_at_one(self._graphs[key] for key in sources)

    @staticmethod
    def _made_at_one(graph: CompiledGraph, first_step) -> None:
        """Keep in `graph` its batch 1 made from `first_step` (its one-step trace there, made not traced; None: not
        made, traced where asked for)."""
        if first_step is not None and 1 not in graph._exact:
            graph._tracer.first_steps[1] = first_step
            graph._exact[1] = graph._tracer(1)  # its second step made from it, not traced

    def _trace_side_by_side(self, graphs, size: int = 1) -> None:
        """Batch `size` of each of `graphs` traced in forked workers (one alone here)."""
        graphs = list(graphs)
        jobs = [functools.partial(traced_at, g._tracer, size) for g in graphs]
        for graph, made in zip(graphs, run_forked(jobs) if len(jobs) > 1 else [job() for job in jobs], strict=True):
            keep_traced(graph, size, made)

    @property
    def traces(self) -> int:
        """Training programs run under fake tensors so far: each distinct program at each batch size it was traced
        at (two or three for the affine fit, batch 1 where it runs a program of its own, every batch of a program
        that is not affine)."""
        return sum(len(graph._exact) for graph in self._graphs.values())

    @property
    def spliced_traces(self) -> int:
        """Of `traces`, those made and not traced: a program with step in backward from its program without it and the
        optimizer's updates alone (`calcgraph.derive.in_backward`)."""
        return sum(trace.spliced for graph in self._graphs.values() for trace in graph._exact.values())

    @property
    def composed_traces(self) -> int:
        """Of `traces`, those made and not traced: a checkpoint placement from its plain and every-block programs
        (`calcgraph.placements.compose`)."""
        return sum(trace.composed for graph in self._graphs.values() for trace in graph._exact.values())

    @property
    def one_step_traces(self) -> int:
        """Of `traces`, those traced for one step, the second made from it (`CompiledGraph`'s `one_step`)."""
        return sum(trace.repeats is not None for graph in self._graphs.values() for trace in graph._exact.values())

    def plan(self, cfg: Config, segments: Sequence | None = None) -> Plan:
        if self._unchecked:  # every precision calibrated that will be (see `advise`)
            self.check_lines()
        rep = self._key(cfg, segments)[0]
        graph = self.graph(cfg, segments)
        if cfg.precision in self._calibrated and graph.affine:
            plain, calibrated = self._calibrated[cfg.precision]
            if id(graph) not in self._views:
                self._views[id(graph)] = calibrated if graph is plain else graph.calibrated_like(calibrated)
            graph = self._views[id(graph)]
        return Plan(graph, self._state_bytes(cfg) - self._state_bytes(rep), self._peaks)

    def forget_peaks(self) -> None:
        """Drop the programs' remembered peaks (a graph recalibrated: its plan changed)."""
        self._peaks.clear()

    def _state_bytes(self, cfg: Config) -> int:
        """Bytes of the packed optimizer state `cfg` holds (0 for torch's optimizers: never swapped)."""
        if cfg.precision != "bf16" or self._packed is None:
            return 0
        key = (cfg.extra_bits, cfg.state_dtype)
        if key not in self._states:
            self._states[key] = self.work.state_bytes(cfg)
        return self._states[key]

    def calibrate(self, precision: Config, batch_size: int) -> int:
        """Measure the kernels' scratch of `precision`'s plain program (real steps at small batches; see the
        module docstring) for every later plan of that precision, once. Returns the real steps taken."""
        graph, key = self.graph(precision), self._key(precision, None)
        if precision.precision in self._calibrated or not graph.affine or self.no_allocator_events:
            return 0
        # NOTE: a shallow copy, not a second trace of the same program (a bf16 one at 100M parameters traces for
        # minutes): calibrating rebinds the copy's own calibration, and an affine plan reads its traces without
        # adding to them. Checked (and refined once where it misses) only at a batch beyond the calibrated
        # sizes, where the fit extrapolates; a batch within them is interpolated between two measured sizes.
        # Batch 1 runs a program of its own (`CompiledGraph._batch_one`: one more trace and one more real step,
        # and a model with BatchNorm refuses it after both): calibrated only for a user's batch of 1
        check = (min(16, batch_size),) if batch_size > 8 else ()
        sizes = (1, 2, 4) if batch_size == 1 else (2, 4, 8)
        # a batch that is not a power of two is planned with what kernels take at such batches (issue 48: oneDNN's
        # AMX matmul pads odd batches); one past the power of two below it is the run that bounds its octave, or
        # where that is the batch itself (held out from calibration), the next octave's
        probe = unaligned_probe(batch_size)
        probe = 2 * batch_size - 1 if probe == batch_size else probe
        sizes += (probe,) if probe is not None and probe not in sizes + check else ()
        try:
            calibrated = copy.copy(graph).calibrate(sizes=sizes, check=check, refine=1)
        except NoAllocatorEvents as error:  # see plan_training: said, and the plans stay uncalibrated
            warnings.warn(f"{error}: the plans are not calibrated", stacklevel=2)
            self.no_allocator_events = True
            return 1
        # the line checked by these runs, or, where they do not show it, by a trace when a plan is next asked for
        ran = {int(s) for s in calibrated.calibration.sizes} - set(graph._fitted_at)
        if ran and calibrated.calibration.line_held:
            self._unchecked.pop(key, None)
        self._calibrated[precision.precision] = graph, calibrated
        self._views.clear()  # plans made before now were uncalibrated
        self.forget_peaks()
        checks = calibrated.calibration_error
        return len(sizes) + len(check) + (int(checks["refined"].max()) if len(checks) else 0)

