"""What a schedule is: micro-steps of samples per section, and one total order of operations.

Plain Python, no JAX. Operations:
  F(s, k)   forward of micro-step k of section s (the sink's F is its loss-and-grad);
  X(e, k)   transfer of producer micro-step k's output along edge e to the consumer's mesh;
  XB(e, k)  transfer of the summed cotangent of that output back to the producer's mesh;
  B(s, k)   backward of a trained producer's micro-step k;
  U(s)      optimizer update of a trained section.
Rows of a micro-step are laid out shard-major: row r sits on data shard r // micro_batch.

Placement (any data-parallel degrees on either side of an edge): shard i of a section with DP
shards holds the share [i/DP, (i+1)/DP) of the batch, and producer shard i feeds consumer shard
j when their shares overlap (`feeders`). For DP(consumer) = f * DP(producer) that is the block
map (producer shard i feeds consumer shards i*f .. i*f+f-1); for fan-in and uneven degrees (6 -> 2,
3 -> 4) a consumer shard has several feeders. A schedule puts each sample, in every section it
activates, on a shard that its producer's shard feeds; the schedulers do so by giving the sample
one position in [0, 1) and every section the shard holding it (`shard_of`). The consumer then
receives, per producer micro-step, the rows of its feeders (`delivered`), so it finds every row
it needs on its own shard.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from maestro_jax.core.graph import ask, sample_view
from maestro_jax.core.plan import EdgeInfo
from maestro_jax.schedule.packing import Pack


class ScheduleError(ValueError):
    pass


def feeders(dp: int, dp_other: int, j: int) -> range:
    """The shards of a `dp`-way split of the batch whose share overlaps shard `j` of a
    `dp_other`-way split: `feeders(DP(p), DP(c), j)` are the producer shards that feed consumer
    shard j, `feeders(DP(c), DP(p), i)` the consumer shards that producer shard i feeds."""
    return range(j * dp // dp_other, -(-(j + 1) * dp // dp_other))


def feeds(dp_p: int, i: int, dp_c: int, j: int) -> bool:
    """Whether producer shard i (of DP(p)) feeds consumer shard j (of DP(c)): their shares overlap."""
    return i * dp_c < (j + 1) * dp_p and j * dp_p < (i + 1) * dp_c


@functools.lru_cache(maxsize=256)
def delivered(dp_p: int, dp_c: int) -> tuple[tuple[range, ...], int]:
    """How a producer micro-step reaches the consumer: per consumer shard, its feeders (whose
    rows it receives whole, in shard order), and the most any shard has (`width`): each consumer
    shard holds `width` producer shards' rows (zero-padded), so the transferred array has
    DP(c) * width * micro_batch(p) rows. 1 for fan-out; DP(p)/DP(c) for fan-in; uneven degrees
    add one for the shards on a boundary (3 -> 4: 2; 6 -> 4: 2)."""
    ranges = tuple(feeders(dp_p, dp_c, j) for j in range(dp_c))
    return ranges, max(len(r) for r in ranges)


_GOLDEN = 0x9E3779B1  # 2**32 / golden ratio: the positions of consecutive samples spread evenly


def shard_of(dp_from: int, dp_to: int, c: int, x: int) -> int:
    """The shard of a `dp_to`-way split that sample `x`, on shard `c` of a `dp_from`-way split (the
    sink's), sits on: the one holding the sample's position c + frac(x * golden ratio), in units
    of `dp_from` shards. Every section placed this way from the same shard c holds the sample at
    one common position, so every edge between them feeds it (`feeds`). When one shard of
    `dp_to` covers shard c whole (DP(to) divides DP(from)) that is c // (DP(from) / DP(to)),
    whatever the sample; otherwise the samples of shard c spread over the shards it overlaps in
    proportion to the overlap."""
    first = c * dp_to // dp_from
    if (c + 1) * dp_to <= (first + 1) * dp_from:
        return first
    return ((c << 32) + (x * _GOLDEN & 0xFFFFFFFF)) * dp_to // (dp_from << 32)


@dataclasses.dataclass(frozen=True)
class SampleMeta:
    """What the scheduler knows of a sample: the sections it activates and its work in each."""

    sections: frozenset[str]
    work: Mapping[str, int]


def sample_metas(graph, samples: Sequence) -> list[SampleMeta]:
    """What the scheduler needs of each sample (a `Sample` or its `SampleInfo`), asked of the
    graph's sections in graph order."""
    metas = []
    for x in samples:
        info = sample_view(x)
        active = [s for s in graph.sections if ask(s, "activates", info)]
        metas.append(SampleMeta(frozenset(s.name for s in active), {s.name: ask(s, "work", info) for s in active}))
    return metas


def ahead_sections(order: Sequence[str], trained: frozenset[str], edges: Sequence[EdgeInfo]) -> frozenset[str]:
    """The sections that may run ahead (`Problem.ahead`): frozen, every producer such a section."""
    out: set[str] = set()
    for s in order:  # topological
        if s not in trained and all(e.src in out for e in edges if e.dst == s):
            out.add(s)
    return frozenset(out)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The graph and plan as the scheduler sees them."""

    order: tuple[str, ...]  # topological
    sink: str
    trained: frozenset[str]
    edges: tuple[EdgeInfo, ...]
    rows: Mapping[str, int]
    dp: Mapping[str, int]
    max_in_flight: int = 4
    groups: Mapping[str, str] = dataclasses.field(default_factory=dict)  # co-located section -> its device group
    run_ahead: int = 0  # global batches the `ahead` sections compute before the step that trains on them
    # tighter stash bounds by section: stage i of a section in K pipeline stages holds at most K - i
    # micro-steps for their backward, as 1F1B does (`pipeline_bounds`)
    bounds: Mapping[str, int] = dataclasses.field(default_factory=dict)
    # sections that pack sequences (`schedule.packing`): their `rows` count sample slots, and the
    # cost model prices their micro-steps as the packed rows (`timing.work_time`)
    pack: Mapping[str, Pack] = dataclasses.field(default_factory=dict)
    # the wavefront may deal the sink's rows to balance its producers (`schedule.balance_shards`)
    balance_shards: bool = True

    def in_flight(self, s: str) -> int:
        """How many of section s's forwards may wait for their backward at once."""
        return min(self.max_in_flight, self.bounds.get(s, self.max_in_flight))

    @functools.cached_property
    def ahead(self) -> frozenset[str]:
        """The sections that run ahead under `run_ahead`: frozen ones whose inputs are only data
        and other such sections (a teacher, a frozen encoder reading raw samples). Nothing they
        compute depends on a trained weight, so batch N+1's forwards give the same values during
        step N as during step N+1."""
        return ahead_sections(self.order, self.trained, self.edges) if self.run_ahead else frozenset()

    def is_ahead(self, op: Op) -> bool:
        """Whether `op` runs during the previous step: a forward of an `ahead` section or a
        transfer out of one (they have no backward)."""
        return op.section in self.ahead and op.kind in ("F", "X")

    def group(self, s: str) -> str:
        """The device group section s runs on: sections sharing devices run one at a time."""
        return self.groups.get(s, s)

    def micro_batch(self, s: str) -> int:
        return self.rows[s] // self.dp[s]

    def in_edges(self, s: str) -> tuple[EdgeInfo, ...]:
        return tuple(e for e in self.edges if e.dst == s)

    def out_edges(self, s: str) -> tuple[EdgeInfo, ...]:
        return tuple(e for e in self.edges if e.src == s)

    def needs_backward(self, s: str) -> bool:
        return s in self.trained and s != self.sink

    def sends_cotangent(self, e: EdgeInfo) -> bool:
        return e.src in self.trained


@dataclasses.dataclass(frozen=True)
class MicroStep:
    section: str
    index: int
    positions: tuple[int, ...]  # each row's sample position in the global batch; -1 is padding
    deps: Mapping[str, tuple[int, ...]]  # in-edge -> producer micro-step indices, in route order

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(filter((0).__le__, self.positions))


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # F, X, XB, B, U
    section: str
    step: int = -1
    edge: str | None = None

    def __str__(self) -> str:
        if self.kind in ("X", "XB"):
            return f"{self.kind}({self.edge},{self.step})"
        return f"{self.kind}({self.section})" if self.kind == "U" else f"{self.kind}({self.section},{self.step})"


@dataclasses.dataclass(frozen=True)
class Schedule:
    steps: Mapping[str, tuple[MicroStep, ...]]
    ops: tuple[Op, ...]
    num_samples: int
    name: str = "naive"

    def routes(self, problem: Problem, section: str, index: int) -> dict[str, list[int]]:
        """Per in-edge, each row's index into the consumer's inputs (-1: none): the producer
        micro-steps it depends on, joined along rows, each as the consumer receives it
        (`delivered`: consumer shard j holds its feeders' rows in `width` blocks of the producer's
        micro-batch, so row q of producer shard i sits at (j * width + i - first feeder of j) *
        micro_batch(p) + q % micro_batch(p)). Every index points at the shard of the row that
        reads it, so a consumer gathers locally (`mj.rows.gather`); a sample placed on a consumer
        shard its producer shard does not feed is a ScheduleError. With equal data-parallel
        degrees this is the plain index into the concatenated producer outputs."""
        step = self.steps[section][index]
        mb_c, out = problem.micro_batch(section), {}
        for e in problem.in_edges(section):
            mb_p, dp_c = problem.micro_batch(e.src), problem.dp[section]
            feeding, width = delivered(problem.dp[e.src], dp_c)
            where = {}
            for pos, k in enumerate(step.deps.get(e.name, ())):
                for q, sample in enumerate(self.steps[e.src][k].positions):
                    if sample >= 0:
                        where[sample] = (pos, q)
            route = []
            for r, x in enumerate(step.positions):
                if x < 0 or x not in where:
                    route.append(-1)
                    continue
                pos, q = where[x]
                i, j = q // mb_p, r // mb_c
                if i not in feeding[j]:
                    raise ScheduleError(
                        f"sample {x}: {e.src} shard {i} does not feed {section} shard {j} "
                        f"(its feeders are {e.src} shards {feeding[j].start}..{feeding[j].stop - 1})"
                    )
                route.append(((pos * dp_c + j) * width + i - feeding[j].start) * mb_p + q % mb_p)
            out[e.name] = route
        return out


def chunk(samples: Sequence[int], rows: int) -> list[tuple[int, ...]]:
    out = []
    for i in range(0, len(samples), rows):
        part = tuple(samples[i : i + rows])
        out.append(part + (-1,) * (rows - len(part)))
    return out


def link(
    problem: Problem, rows_by_section: Mapping[str, Sequence[tuple[int, ...]]]
) -> dict[str, tuple[MicroStep, ...]]:
    """Micro-steps with their producer dependencies derived from which samples they hold (which
    step holds each sample is mapped for the producers of edges only)."""
    sources = {e.src for e in problem.edges}
    home = {
        s: {x: k for k, rows in enumerate(chunks) for x in rows if x >= 0}
        for s, chunks in rows_by_section.items()
        if s in sources
    }
    steps = {}
    for s, chunks in rows_by_section.items():
        built = []
        for k, rows in enumerate(chunks):
            deps = {}
            for e in problem.in_edges(s):
                where = home.get(e.src, {})
                ks = sorted({where[x] for x in rows if x in where})
                if ks:
                    deps[e.name] = tuple(ks)
            built.append(MicroStep(s, k, rows, deps))
        steps[s] = tuple(built)
    return steps


def backward_ops(problem: Problem, steps: Mapping[str, Sequence[MicroStep]]) -> list[Op]:
    """Cotangent transfers and backwards in reverse topological order, then the updates."""
    users = {e.name: consumers(steps, e) for e in problem.edges}
    ops = []
    for s in reversed(problem.order):
        if problem.needs_backward(s):
            for k in range(len(steps[s])):
                ops += [Op("XB", s, k, e.name) for e in problem.out_edges(s) if k in users[e.name]]
                ops.append(Op("B", s, k))
    ops += [Op("U", s) for s in problem.order if s in problem.trained]
    return ops


def consumers(steps, e: EdgeInfo) -> dict[int, list[int]]:
    """Producer micro-step k of edge e -> the consumer micro-steps that depend on it, in order; the
    producer steps nobody consumes are absent. One pass over the consumer's steps, so asking
    for every k costs what the steps hold, not their number squared."""
    out: dict[int, list[int]] = {}
    for st in steps[e.dst]:
        for k in st.deps.get(e.name, ()):
            out.setdefault(k, []).append(st.index)
    return out


def required_ops(schedule: Schedule, problem: Problem) -> dict[Op, list[Op]]:
    """Every op the schedule must contain, mapped to the ops it depends on."""
    steps, req = schedule.steps, {}
    users = {e.name: consumers(steps, e) for e in problem.edges}
    for s in problem.order:
        for st in steps[s]:
            req[Op("F", s, st.index)] = [
                Op("X", e.src, k, e.name) for e in problem.in_edges(s) for k in st.deps.get(e.name, ())
            ]
        for e in problem.out_edges(s):
            for k in range(len(steps[s])):
                if k not in users[e.name]:
                    continue
                req[Op("X", s, k, e.name)] = [Op("F", s, k)]
                if problem.sends_cotangent(e):
                    done = "F" if e.dst == problem.sink else "B"
                    req[Op("XB", s, k, e.name)] = [Op(done, e.dst, j) for j in users[e.name][k]]
    for s in problem.order:
        if problem.needs_backward(s):
            for k in range(len(steps[s])):
                req[Op("B", s, k)] = [Op("F", s, k)] + [
                    Op("XB", s, k, e.name) for e in problem.out_edges(s) if k in users[e.name]
                ]
        if s in problem.trained:
            last = "B" if problem.needs_backward(s) else "F"
            req[Op("U", s)] = [Op(last, s, k) for k in range(len(steps[s]))]
    return req


def pipeline_bounds(stages: Mapping[str, Sequence[str]]) -> dict[str, int]:
    """1F1B's stash bound for every pipeline stage (section -> its stage sections in order):
    stage i of K waits on at most K - i backwards, the last (which holds the loss, or sends a
    frozen teacher's output) on one."""
    return {name: len(order) - i for order in stages.values() if len(order) > 1 for i, name in enumerate(order)}
