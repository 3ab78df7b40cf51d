"""How a step's arrays move between section meshes: a producer micro-step's edge array onto its
consumer's mesh (each consumer shard gets its feeders' rows, `deliver_rows`: any data-parallel
degrees), its cotangent back onto the producer's (summed, `return_rows`), and any array onto a
sharding (the clip norm's squared norms). An abstract twin's moves (`dry`) return the abstract
result and record the transfers' cut and join programs for compiling instead of issuing them.
"""

from __future__ import annotations

from collections.abc import Mapping

from maestro_jax.runtime.programs import DryRun, SectionPrograms
from maestro_jax.runtime.transfer import abstract_transfer, deliver_rows, return_rows, transfer
from maestro_jax.schedule import Problem


class EdgeMoves:
    """The moves of `problem`'s edges between the sections' `programs`' meshes. `compiled`: keys of
    the cut and join programs compiled ahead (shared with an abstract twin, which records the
    others in `dry`)."""

    def __init__(
        self,
        problem: Problem,
        programs: Mapping[str, SectionPrograms],
        dry: DryRun | None = None,
        compiled: set | None = None,
    ):
        self.programs, self.dry = programs, dry
        self.compiled_transfers: set = set() if compiled is None else compiled
        # per edge, how a producer micro-step reaches the consumer and how its cotangent goes back
        self.row_maps = {
            e.name: tuple(
                f(problem.dp[e.src], problem.dp[e.dst], problem.micro_batch(e.src)) for f in (deliver_rows, return_rows)
            )
            for e in problem.edges
        }

    def move(self, x, dst, row_map=None):
        """`transfer` (an abstract twin's: the abstract result, its cut and join programs recorded)."""
        run = self.dry
        if run is None:
            return transfer(x, dst, row_map)
        out, programs = abstract_transfer(x, dst, row_map)
        for key, program in programs.items():
            if key not in self.compiled_transfers:
                run.transfers.setdefault(key, program)
        return out

    def deliver(self, e, x):
        """A producer micro-step's array of edge `e` onto its consumer's mesh (`deliver_rows`)."""
        row_map = self.row_maps[e.name][0]
        return self.move(x, self.programs[e.dst].edge_sharding((row_map.out_rows, *x.shape[1:])), row_map)

    def back(self, e, cotangent):
        """The cotangent of edge `e`'s delivered array back onto its producer's mesh (`return_rows`)."""
        row_map = self.row_maps[e.name][1]
        return self.move(
            cotangent, self.programs[e.src].edge_sharding((row_map.out_rows, *cotangent.shape[1:])), row_map
        )
