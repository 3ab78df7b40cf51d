"""The pricing every side shares (issue 36, fair baselines): the data-parallel gradient reduction
and the optimizer update once per step (`cluster.update_time`), and the expert all-to-all divided
as the layout divides the tokens (`cluster.exchange_s_per_unit`); the monolithic step and each
pipeline stage pay them by the same rule as maestro's sections."""

import dataclasses

import pytest
from conftest import ROOT, paper_spec

from maestro_jax.config import load_config
from maestro_jax.core.graph import UnitCost
from maestro_jax.core.plan import ParamInfo, SectionPlan, mesh_shape
from maestro_jax.planning.cluster import (
    cost_model,
    edge_positions,
    exchange_s_per_unit,
    monolithic_time,
    section_cost,
    transfer_s_per_unit,
    update_time,
)
from maestro_jax.planning.cost import DEVICES, optimizer_update_s, ring_allreduce_s
from maestro_jax.planning.pipeline import one_f_one_b
from maestro_jax.planning.spec import SectionSpec
from maestro_jax.tools.plan import planner_for

VLM = ROOT / "configs/vlm_tiny.yaml"


def layout(devices: int, **mesh) -> SectionPlan:
    return SectionPlan(tuple(range(devices)), mesh_shape(**mesh), 1, precision="bfloat16")


def section(dense: int, experts: int = 0, trained: bool = True, routed_width: int = 0) -> SectionSpec:
    """A section with a dense (embed x mlp) weight and an expert-sharded one, of the given sizes."""
    leaves = [ParamInfo("w", (dense // 64, 64), ("embed", "mlp"), 4)]
    if experts:
        leaves.append(ParamInfo("moe", (8, experts // 512, 64), ("expert", "embed", "mlp"), 4))
    cost = UnitCost(flops=1e9, width=1024, layers=4, routed_width=routed_width)
    return SectionSpec("s", trained, tuple(leaves) if trained else (), cost, () if trained else tuple(leaves))


# -- the optimizer step -----------------------------------------------------------------------
def test_the_ring_moves_twice_the_data_less_a_share():
    assert ring_allreduce_s(8e9, 1, 1e9) == 0.0
    assert ring_allreduce_s(8e9, 2, 1e9) == pytest.approx(8.0)
    assert ring_allreduce_s(8e9, 8, 1e9) == pytest.approx(14.0)
    assert ring_allreduce_s(8e9, 1024, 1e9) < 16.0


def test_no_data_parallel_replica_no_reduction():
    """One replica of the weights (fsdp and tensor shards only): the step is the update alone."""
    spec = section(1 << 24)
    for sp in (layout(1), layout(8, fsdp=8), layout(8, fsdp=2, tensor=4)):
        shards = sp.axis_sizes["fsdp"] * sp.axis_sizes["tensor"]
        assert update_time(spec, sp, "h100", 50.0) == pytest.approx(optimizer_update_s((1 << 24) / shards, "h100"))


def test_the_reduction_grows_with_the_parameters_and_the_replicas():
    small, large = section(1 << 22), section(1 << 24)
    sp = layout(16, data=16)
    reduce = {s: update_time(s, sp, "h100", 50.0) - update_time(s, layout(1), "h100", 50.0) for s in (small, large)}
    assert reduce[large] == pytest.approx(4 * reduce[small])
    times = [update_time(large, layout(n, data=n), "h100", 50.0) for n in (1, 2, 4, 8, 16)]
    assert times == sorted(times) and times[0] < times[1]
    # beyond a node the replicas reduce over the inter-node link
    inside = update_time(large, layout(8, data=8), "h100", 50.0) - update_time(large, layout(1), "h100", 50.0)
    across = update_time(large, layout(16, data=16), "h100", 50.0) - update_time(large, layout(1), "h100", 50.0)
    assert across > 5 * inside


def test_the_reduction_hides_behind_the_last_backward_up_to_its_length():
    """Only the part of the reduction longer than the compute beside it shows; the update never hides."""
    spec, sp = section(1 << 24), layout(16, data=16)
    update = optimizer_update_s(1 << 24, "h100")
    reduction = update_time(spec, sp, "h100", 50.0) - update
    assert reduction > 0
    assert update_time(spec, sp, "h100", 50.0, hidden=reduction / 4) == pytest.approx(update + reduction * 3 / 4)
    assert update_time(spec, sp, "h100", 50.0, hidden=10 * reduction) == pytest.approx(update)


def test_a_frozen_section_has_no_step():
    assert update_time(section(1 << 24, trained=False), layout(16, data=16), "h100", 50.0) == 0.0


def test_the_experts_reduce_over_data_and_context_only():
    """Expert weights are sharded over `expert` (no replica to reduce with there); the dense
    weights are replicated over it, and reduce over it."""
    dense_only, with_experts = section(1 << 22), section(1 << 22, experts=1 << 24)
    sp = layout(8, expert=8)
    extra = update_time(with_experts, sp, "h100", 50.0) - update_time(dense_only, sp, "h100", 50.0)
    assert extra == pytest.approx(optimizer_update_s((1 << 24) / 8, "h100"))  # the experts' update, no reduction
    assert update_time(dense_only, sp, "h100", 50.0) > optimizer_update_s(1 << 22, "h100")


def test_the_update_is_memory_bound_at_hbm_bandwidth():
    assert optimizer_update_s(1e9, "h200") < optimizer_update_s(1e9, "h100")
    assert optimizer_update_s(2e9, "h100") == pytest.approx(2 * optimizer_update_s(1e9, "h100"))


# -- the expert exchange ----------------------------------------------------------------------
def test_the_all_to_all_halves_when_tensor_doubles(monkeypatch):
    """With the in-node gather made free, what each device sends over the expert all-to-all
    halves each time the tensor degree doubles: each tensor rank sends its share of the tokens."""
    monkeypatch.setitem(DEVICES, "h100", {**DEVICES["h100"], "link": float("inf")})
    spec = section(1 << 20, experts=1 << 22, routed_width=8 * 1024)
    times = [exchange_s_per_unit(spec, layout(16 * t, expert=16, tensor=t), "h100", 50.0) for t in (1, 2, 4, 8)]
    assert times[0] > 0
    assert times[1:] == pytest.approx([times[0] / 2, times[0] / 4, times[0] / 8])


def test_the_tensor_group_gathers_what_it_received():
    """Under tensor parallelism the tensor group all-gathers the routed tokens (and reduce-scatters
    the results) inside its node; without expert parallelism nothing is exchanged."""
    spec = section(1 << 20, experts=1 << 22, routed_width=8 * 1024)
    one = exchange_s_per_unit(spec, layout(16, expert=16), "h100", 50.0)
    four = exchange_s_per_unit(spec, layout(64, expert=16, tensor=4), "h100", 50.0)
    cross_node_share = one / 4
    assert cross_node_share < four < one
    assert exchange_s_per_unit(spec, layout(4, tensor=4), "h100", 50.0) == 0.0


# -- the same rule on every side --------------------------------------------------------------
def test_every_side_pays_the_same_step():
    """The cost model gives the simulator each trained section's step (the U op), the monolithic
    step adds them after its last micro-batch, and a pipeline stage's step waits for its own drain
    only (the stages after it finish earlier and step while it drains)."""
    p = planner_for(load_config(VLM, ["simulate.device=h100"]), 8, 1.0)
    sp = SectionPlan(tuple(range(8)), mesh_shape(data=8), 1)
    plans = {s: dataclasses.replace(sp, precision=sec.precision) for s, sec in p.spec.sections.items()}
    cost = cost_model(p.spec, plans, p.metas, p.device, p.link_gbps, p.typical_units)
    steps = {}
    for s, sec in p.spec.sections.items():
        c = section_cost(sec, plans[s], p.metas, p.device, p.link_gbps, s == p.spec.sink, p.typical_units[s])
        steps[s] = c.update_s
        exposed = update_time(sec, plans[s], p.device, p.link_gbps)
        assert (c.update_s > 0) == sec.trained and c.update_s <= exposed, "part of the reduction hides"
    assert cost.update_s == {s: t for s, t in steps.items() if t} and cost.update_s
    without = dataclasses.replace(cost, update_s={})
    for metas in p.metas:
        mono = monolithic_time(p.spec, metas, cost, 1, sp.rows)
        assert mono == pytest.approx(monolithic_time(p.spec, metas, without, 1, sp.rows) + sum(steps.values()))
        alone = monolithic_time(p.spec, metas, cost, 1, sp.rows, only=p.spec.sink)
        assert alone == pytest.approx(
            monolithic_time(p.spec, metas, without, 1, sp.rows, only=p.spec.sink) + steps[p.spec.sink]
        )
    f, b = [[1.0] * 4, [1.0] * 4], [[2.0] * 4, [2.0] * 4]
    base = one_f_one_b(f, b)
    assert one_f_one_b(f, b, update=[0.5, 0.0]) == pytest.approx(base + 0.5)  # the first stage drains last
    assert one_f_one_b(f, b, update=[0.0, 0.5]) == pytest.approx(base)  # hidden behind the first's drain


def test_an_edge_of_positions_moves_each_devices_slice_and_an_undeclared_one_whole_rows():
    """Between two 16-device groups of data 2 x context 2 x tensor 4 (`transfer_s_per_unit`): an
    edge declaring a rows x positions x features layout whose positions the meshes split 8 ways
    sends an eighth of a shard's rows from every device over the inter-node link, then each
    destination device gathers its 3 other `tensor` slices over the node's links; positions that
    only `context` divides split 2 ways, each received tile copied to its 3 `tensor` replicas;
    an undeclared edge (0 positions) sends whole rows, each tile copied to its 7 replicas."""
    src = SectionPlan(tuple(range(16)), mesh_shape(data=2, context=2, tensor=4), 1)
    dst = dataclasses.replace(src, devices=tuple(range(16, 32)))
    link, node = 50.0e9, DEVICES["h100"]["link"]

    def price(positions: int) -> float:
        return transfer_s_per_unit(1.0, src, dst, False, "h100", 50.0, positions)

    assert price(0) == pytest.approx(1 / (2 * link) + (1 / 2) * 7 / node)
    assert price(6) == pytest.approx(1 / (2 * 2 * link) + (1 / 4) * 3 / node)
    assert price(256) == pytest.approx(1 / (2 * 8 * link) + (1 / 16) * 3 / node)
    assert price(256) < price(6) < price(0)


def test_the_planner_credits_the_split_only_to_edges_that_take_slices_whose_buckets_divide():
    """`edge_positions`: a stage edge sends one position a token, so its micro-steps hold
    multiples of the analytic bucket's 256 positions; the image edge declares none (the LLM picks
    single positions of it into its rows, gathering them whole), and neither does a KD teacher's
    (the student joins teacher micro-steps of other lengths); a declared fraction of a position
    per bucket credits nothing."""
    for config, edge in (("vlm", "image_embeds"), ("kd", "teacher_hidden")):
        spec = paper_spec(config)
        assert spec.edge_positions == {}
        assert edge_positions(spec, edge, 256) == 0
        staged = spec.staged({spec.sink: 2})
        stage = f"{spec.sink}.0>1"
        assert staged.edge_positions == {stage: 1.0}
        assert edge_positions(staged, stage, 256) == 256
        assert edge_positions(dataclasses.replace(staged, edge_positions={stage: 0.25}), stage, 2) == 0


def test_the_built_in_sections_declare_the_kind_of_layer_they_run():
    """The paper VLM's tower is priced at the ViT block's measured rate and its mixture-of-experts
    LLM at the MoE decoder's; the KD paper config's dense teacher and student at the dense
    curve's (`UnitCost.rate_kind`, `cost.KIND_RATE`): from the same cost functions the planner reads."""
    kinds = {}
    for name in ("vlm", "kd"):
        spec = paper_spec(name)
        kinds |= {f"{name}.{s}": spec.sections[s].cost.rate_kind for s in spec.sections}
    assert kinds == {
        "vlm.vision": "vit",
        "vlm.llm": "decoder_moe",
        "kd.teacher": "decoder",
        "kd.student": "decoder",
    }
