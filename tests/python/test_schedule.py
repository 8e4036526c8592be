"""hyperparallel.schedule: the C++ schedule room from Python.

The numbers checked here have a reason of their own: the closed forms of the
schedules (seed 004, the Zero Bubble paper), the Zero Bubble paper's printed
bubble rates on its own inputs (arXiv 2401.10241, Table 5 with Table 9's
costs), the layouts docs/schedules.md states, and the C++ CLI's own CSV.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import threading
import xml.etree.ElementTree as ET

import pytest

from hyperparallel import schedule as hs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The generators docs/schedules.md lists, in its order.
DOCUMENTED = [
    "naive", "gpipe", "1f1b", "interleaved-1f1b", "interleaved-1f1b-fb", "interleaved-bfs",
    "interleaved-zb", "zb-h1", "zb-h2", "zbv", "zbv-fb", "dualpipe", "dualpipev", "zb-auto",
    "zbv-auto", "v-min", "v-half",
    "v-zb", "auto",
]


def built(p=4, m=8):
    return {name: hs.build(name, p, m) for name in hs.names()}


# ---------------------------------------------------------------------------
# Listing and building


def test_names_are_the_documented_generators():
    assert hs.names() == DOCUMENTED
    for name in hs.names():
        assert hs.describe(name)


def test_every_generator_builds_validates_and_lowers():
    for name, s in built().items():
        assert s.num_ranks == 4 and s.num_microbatches == 8 and not s.lowered, name
        assert all(a.is_compute for row in s.actions for a in row), name
        hs.validate(s)
        low = hs.lower(s)
        assert low.lowered
        hs.validate(low)
        ops = {a.op for row in low.actions for a in row}
        assert {hs.Op.SEND_F, hs.Op.RECV_F, hs.Op.SEND_B, hs.Op.RECV_B} <= ops, name
        # Lowering only adds communication.
        assert [[a for a in row if a.is_compute] for row in low.actions] == s.actions, name


def test_unmet_constraints_are_value_errors_that_say_what_to_change():
    with pytest.raises(ValueError, match=r"m % p == 0\); got m=6, p=4; use m=8"):
        hs.build("interleaved-1f1b", 4, 6)
    with pytest.raises(ValueError, match="unknown schedule 'nope'; known: naive, gpipe"):
        hs.build("nope", 4, 8)
    with pytest.raises(ValueError, match="at least 1 rank"):
        hs.build("1f1b", 0, 8)
    with pytest.raises(ValueError, match="dualpipe"):
        hs.build("dualpipe", 3, 8)  # needs an even number of ranks
    # NOTE [One size rule]: checked before any work, the same at every entry point.
    with pytest.raises(ValueError, match="100000 ranks; at most 4096"):
        hs.build("1f1b", 100000, 1000000)
    with pytest.raises(ValueError, match="too many to schedule in seconds.*use at most 2048"):
        hs.build("1f1b", 2, 10**9)


def test_wrong_types_are_type_errors():
    with pytest.raises(TypeError):
        hs.build(4, 4, 8)
    with pytest.raises(TypeError):
        hs.build("1f1b", "4", 8)
    with pytest.raises(TypeError):
        hs.build("1f1b", 4.5, 8)
    with pytest.raises(TypeError):
        hs.build("zb-auto", 4, 8, costs={"f": 1})
    with pytest.raises(TypeError):
        hs.build("zb-auto", 4, 8, mem_limit=[2])
    with pytest.raises(TypeError):
        hs.simulate("zb-h1")
    with pytest.raises(TypeError):
        hs.validate(None)


def test_interleaved_chunks():
    s = hs.build("interleaved-1f1b", 4, 8, chunks=3)
    assert s.num_stages == 12 and s.stage_rank == [i % 4 for i in range(12)]
    with pytest.raises(ValueError, match="v >= 1"):
        hs.build("interleaved-1f1b", 4, 8, chunks=0)


def test_layouts_as_documented():
    s = built()
    # Loop placement: stage s on rank s % p, one route through every stage.
    assert s["1f1b"].stage_rank == [0, 1, 2, 3] and s["1f1b"].routes == [[0, 1, 2, 3]]
    # V placement: rank r holds stages r and 2p-1-r.
    for name in ("zbv", "zbv-auto", "dualpipev"):
        v = s[name]
        assert v.num_stages == 8 and v.routes == [list(range(8))]
        for r in range(4):
            assert v.stages_of_rank(r) == sorted([r, 7 - r])
    # DualPipe: two mirrored copies; microbatches [0, m/2) go down 0..p-1 and
    # [m/2, m) up p..2p-1; stage p+j computes chunk j on rank p-1-j.
    d = s["dualpipe"]
    assert d.routes == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert d.microbatch_route == [0] * 4 + [1] * 4
    assert d.stage_chunk == [0, 1, 2, 3, 0, 1, 2, 3] and d.num_chunks == 4
    assert d.stage_rank == [0, 1, 2, 3, 3, 2, 1, 0]
    assert d.route(5) == [4, 5, 6, 7] and d.next_stage(5, 5) == 6 and d.prev_stage(4, 5) == -1
    assert d.route_position(2, 0) == 2 and d.route_position(2, 5) == -1
    with pytest.raises(IndexError):
        d.route(8)
    # FB pairs are in the lists as actions with two halves.
    fb = [a for row in d.actions for a in row if a.op == hs.Op.FB]
    assert fb and all(len(a.halves) == 2 for a in fb)


# ---------------------------------------------------------------------------
# Simulation against closed forms and the paper


def test_unit_cost_bubbles_match_the_closed_forms():
    p, m = 4, 8
    unit = hs.CostModel(f=1, b=1, w=1)
    s = built(p, m)
    work = m * 3
    # GPipe and 1F1B: (p-1)(F+B+W) of bubble; wall-clock share (p-1)/(m+p-1).
    for name in ("gpipe", "1f1b"):
        r = hs.simulate(s[name], unit)
        assert r.makespan == pytest.approx(work + (p - 1) * 3)
        assert r.idle_fraction == pytest.approx((p - 1) / (m + p - 1))
    # ZB-H1: (p-1)(F+B-W); ZB-H2 (m >= 2p): (p-1)(F+B-2W) = 0.
    r = hs.simulate(s["zb-h1"], unit)
    assert r.bubble_rate == pytest.approx((p - 1) / (work + p - 1))
    assert hs.simulate(s["zb-h2"], unit).bubble_rate == pytest.approx(0)
    # Interleaved, v = 2: (p-1)(F+B+W)/v; seed 004's example idle 3/19.
    r = hs.simulate(s["interleaved-1f1b"], unit)
    assert r.idle_fraction == pytest.approx(3 / 19)
    # Naive: one microbatch at a time through every stage.
    assert hs.simulate(s["naive"], unit).makespan == pytest.approx(m * p * 3)
    # The closed forms the library prints agree.
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b"):
        cf = hs.closed_form(name, p, m, 2, unit)
        assert cf.known and cf.matches_simulator
        assert hs.simulate(s[name], unit).bubble_rate == pytest.approx(cf.bubble_rate), name
    assert not hs.closed_form("zb-auto", p, m).known


# arXiv 2401.10241 Table 9 (T_F, T_B, T_W, T_comm profiled in ZB-2p), Table 3
# (hidden size h, heads a) and Table 5's printed bubble rates.
PAPER = [
    # model, p, m, T_F, T_B, T_W, T_comm, h, a, 1F1B, ZB-H1, ZB-H2, ZB-1p, ZB-2p
    ("1.5B", 8, 24, 18.522, 18.086, 9.337, 0.601, 2304, 24, 0.2431, 0.1585, 0.1083, 0.1585, 0.0433),
    ("6.2B", 8, 32, 29.802, 29.428, 19.530, 0.577, 4096, 32, 0.1898, 0.1045, 0.0559, 0.1045, 0.0022),
]


@pytest.mark.parametrize("row", PAPER, ids=[f"{r[0]}-m{r[2]}" for r in PAPER])
def test_paper_table5_bubble_rates(row):
    _, p, m, f, b, w, comm, h, a, r1f1b, rh1, rh2, r1p, r2p = row
    # The paper's memory model per token (s = 1024): M_B = 34h + 5as, M_W = 32h.
    mem_b, mem_w = 34 * h + 5 * a * 1024, 32 * h
    costs = hs.CostModel(f=f, b=b, w=w, comm=comm, mem_b=1.0, mem_w=mem_w / mem_b)
    rate = lambda s: round(hs.simulate(s, costs, record_timeline=False).bubble_rate, 4)  # noqa: E731
    assert rate(hs.build("1f1b", p, m)) == r1f1b
    assert rate(hs.build("zb-h1", p, m)) == rh1
    assert rate(hs.build("zb-h2", p, m)) == rh2
    # zb-auto under the paper's limits: ZB-1p = p M_B, ZB-2p = 2p M_B; at most
    # the paper's rate and within the limit.
    for limit, paper in (("1x", r1p), ("2x", r2p)):
        s = hs.build("zb-auto", p, m, costs=costs, mem_limit=limit)
        r = hs.simulate(s, costs, record_timeline=False)
        assert round(r.bubble_rate, 4) <= paper
        assert r.max_peak_memory <= hs.mem_limit_value(limit, p, costs) + 1e-9
        # No schedule within the limit has a shorter span than the bound.
        bound = hs.span_lower_bound(p, m, costs, hs.mem_limit_value(limit, p, costs))
        assert r.span >= bound - 1e-9


def test_zb_auto_keeps_its_memory_limit():
    costs = hs.CostModel(f=1, b=1.2, w=0.7, comm=0.1)
    p, m = 4, 12
    peaks = {}
    for limit in ("1x", "1.5x", "2x", 7.0):
        s = hs.build("zb-auto", p, m, costs=costs, mem_limit=limit)
        r = hs.simulate(s, costs)
        assert r.max_peak_memory <= hs.mem_limit_value(limit, p, costs) + 1e-9, limit
        peaks[limit] = r
    # More memory never makes it slower.
    assert peaks["2x"].span <= peaks["1x"].span + 1e-9
    # The same search with no local search is a valid schedule too, never better.
    raw = hs.zb_auto(p, m, costs, mem_limit="2x", refine_work=0)
    assert hs.simulate(raw, costs).span >= peaks["2x"].span - 1e-9
    with pytest.raises(ValueError, match="limit"):
        hs.build("zb-auto", p, m, costs=costs, mem_limit=0.5)  # less than one microbatch
    for bad in ("x", "-1x", "two"):
        with pytest.raises(ValueError, match="mem_limit"):
            hs.build("zb-auto", p, m, mem_limit=bad)
    assert hs.mem_limit_value("2x", 4, hs.CostModel(mem_b=3)) == 24
    assert hs.mem_limit_value(None, 4) == 0 and hs.mem_limit_value(5, 4) == 5


def test_per_stage_costs():
    p, m = 4, 3
    f, b, w = [1.0, 1.5, 2.0, 3.0], [1.0, 2.0, 2.5, 3.5], [0.5, 1.0, 1.0, 2.0]
    comm = [0.25, 0.5, 0.75, 0.0]
    costs = hs.CostModel(stage_f=f, stage_b=b, stage_w=w, stage_comm=comm)
    assert costs.per_stage and costs.stage_f == f
    # Naive runs one microbatch at a time: each costs every stage's F + B + W
    # and two transfers over every boundary.
    r = hs.simulate(hs.build("naive", p, m), costs)
    one = sum(f) + sum(b) + sum(w) + 2 * sum(comm[:-1])
    assert r.makespan == pytest.approx(m * one)
    # Per-stage busy time is the stage's own work.
    for rank in range(p):
        assert r.rank_busy[rank] == pytest.approx(m * (f[rank] + b[rank] + w[rank]))
    with pytest.raises(ValueError, match="stage_f has 3 entries but the schedule has 4 stages"):
        hs.simulate(hs.build("1f1b", p, m), hs.CostModel(stage_f=[1, 1, 1]))
    with pytest.raises(ValueError, match="F must be a positive"):
        hs.CostModel(f=-1)
    with pytest.raises(ValueError, match="stage F"):
        hs.CostModel(stage_f=[1, 0])
    with pytest.raises(TypeError):
        hs.CostModel(stage_f="fast")
    assert "stage_f=[1, 1.5, 2, 3]" in repr(costs)
    assert pickle.loads(pickle.dumps(costs)).stage_comm == comm


def test_send_occupies_the_sender():
    # NOTE [Sending occupies the sender]: a send keeps its rank busy, so a
    # schedule's step grows with it while the compute it counts does not.
    sched = hs.build("1f1b", 2, 4)
    free = hs.simulate(sched, hs.CostModel(f=1, b=1, w=1, comm=0.25))
    costs = hs.CostModel(f=1, b=1, w=1, comm=0.25, send=0.5)
    busy = hs.simulate(sched, costs)
    assert busy.makespan > free.makespan
    assert busy.rank_busy == pytest.approx(free.rank_busy)
    per_stage = hs.CostModel(f=1, b=1, w=1, comm=0.25, stage_send=[0.5, 0.5])
    assert hs.simulate(sched, per_stage).makespan == pytest.approx(busy.makespan)
    back = pickle.loads(pickle.dumps(per_stage))
    assert back.stage_send == [0.5, 0.5] and pickle.loads(pickle.dumps(costs)).send == 0.5
    assert "send=0.5" in repr(costs)


def test_waits_inside_a_chunk():
    # NOTE [Waits inside a chunk]: an action that runs alone waits its
    # chunk's own communication whole; its event and busy time are its compute.
    sched = hs.build("1f1b", 2, 4)
    plain = hs.simulate(sched, hs.CostModel(f=1, b=1, w=1))
    costs = hs.CostModel(f=1, b=1, w=1)
    costs.stage_inner = [hs.InnerComm(f_waits=2, f=0.25), hs.InnerComm()]
    waited = hs.simulate(sched, costs)
    assert waited.makespan > plain.makespan
    assert waited.rank_busy == pytest.approx(plain.rank_busy)
    forwards = [e for e in waited.timeline.events if e.action.op == hs.Op.F]
    assert len(forwards) == 8
    for e in forwards:
        assert e.end - e.start == pytest.approx(1)
        assert (e.waits, e.waited) == ((2, pytest.approx(0.5)) if e.rank == 0 else (0, 0))
    back = pickle.loads(pickle.dumps(costs))
    assert [c.f_waits for c in back.stage_inner] == [2, 0]
    assert "InnerComm(2, 0.25, 0, 0, 0, 0)" in repr(costs)
    e = hs.Event(0, "0F0", 1, 2, waits=3, waited=0.5)
    assert (e.waits, e.waited) == (3, 0.5)
    costs.stage_inner = [hs.InnerComm(f_waits=-1), hs.InnerComm()]
    with pytest.raises(ValueError, match="non-negative"):
        hs.simulate(sched, costs)


def test_overlapped_pairs_and_what_they_hide():
    # The C++ Simulate.APairTakesTurnsAtTheWaitsInsideItsChunks and
    # ReadyTurnsGiveTheCpuToTheHalfWhoseWaitEndsFirst from Python: rank 1
    # pairs F(1, 1) with B(1, 0), each with one all-to-all of its own.
    sched = hs.Schedule(2, 2, ["0F0 0F1 0B0 0B1", "1F0 1F1+1B0 1B1"])
    costs = hs.CostModel(f=1, b=1, w=1, comm=1, stage_f=[3, 1])
    costs.stage_inner = [hs.InnerComm(), hs.InnerComm(f_waits=1, f=1.5, i_waits=1, i=1.5)]
    plain = hs.simulate(sched, costs)
    assert plain.makespan == pytest.approx(19.5) and plain.rank_pair_hidden == []
    pair = hs.simulate(sched, costs, fb_overlap=True)
    assert pair.makespan == pytest.approx(17)
    # NOTE [What a pair hides, predicted]: 1.5 of rank 1's pair's waits
    # under the other half's nodes, 2 not.
    assert pair.rank_pair_hidden == pytest.approx([0, 1.5])
    assert pair.rank_pair_exposed == pytest.approx([0, 2])
    assert "pairs' waits   42.86 % hidden" in pair.summary()
    costs.stage_inner[1].i = 2.5  # the B's all-to-all back last
    fixed = hs.simulate(sched, costs, fb_overlap=True, pair_turns="fixed")
    ready = hs.simulate(sched, costs, fb_overlap=True)  # auto: ready turns
    assert (fixed.makespan, ready.makespan) == (pytest.approx(19), pytest.approx(18.5))
    assert (fixed.rank_pair_hidden[1], ready.rank_pair_hidden[1]) == (pytest.approx(1),
                                                                      pytest.approx(1.5))
    deferred = hs.simulate(sched, costs, fb_overlap=True, defer_wgrad=True)
    assert deferred.rank_pair_hidden[1] + deferred.rank_pair_exposed[1] > 0
    with pytest.raises(ValueError, match="fb_overlap=True"):
        hs.simulate(sched, costs, defer_wgrad=True)
    with pytest.raises(ValueError, match="'auto', 'ready' or 'fixed'"):
        hs.simulate(sched, costs, fb_overlap=True, pair_turns="soon")


def test_deferred_ws_in_parts():
    # The C++ Simulate.ReadyTurnsFillWaitsWithPartsOfQueuedWs from Python:
    # two pairs on rank 1; the first pair's W, run in 4 parts at the second
    # pair's waits, ends at 11 (whole, under fixed turns, at 10.5) and the
    # step 0.5 sooner.
    sched = hs.Schedule(2, 3, ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1+1B0 1F2+1B1 1B2"])
    costs = hs.CostModel(f=1, b=2, w=1)
    costs.stage_inner = [hs.InnerComm(), hs.InnerComm(f_waits=1, f=2, i_waits=1, i=2)]
    fixed = hs.simulate(sched, costs, fb_overlap=True, defer_wgrad=True)
    parts = hs.simulate(sched, costs, fb_overlap=True, defer_wgrad=True, pair_turns="ready",
                        w_parts=4)
    assert (fixed.makespan, parts.makespan) == (pytest.approx(21.5), pytest.approx(21))
    w0 = [e for e in parts.timeline.events
          if e.action.op == hs.Op.W and (e.action.stage, e.action.microbatch) == (1, 0)]
    assert len(w0) == 1 and (w0[0].start, w0[0].end) == (pytest.approx(10), pytest.approx(11))
    with pytest.raises(ValueError, match="ready turns"):
        hs.simulate(sched, costs, fb_overlap=True, defer_wgrad=True, w_parts=4)


def test_stage_cost_file(tmp_path):
    doc = {"stages": [
        {"f": 1.4, "i": 1.4, "w": 0.7, "comm": 0.3},
        {"f": 1.0, "i": 1.0, "w": 0.8, "comm": 0.3},
        {"f": 1.0, "i": 1.0, "w": 0.8, "comm": 0.3},
        {"f": 1.9, "i": 2.1, "w": 1.0, "mem_b": 1.5, "mem_w": 0.7},
    ]}
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(doc))
    costs = hs.read_stage_costs(path)
    assert costs.stage_b == [1.4, 1.0, 1.0, 2.1] and costs.stage_mem_b == [1, 1, 1, 1.5]
    s = hs.build("zb-auto", 4, 8, costs=costs, mem_limit="2x")
    assert hs.simulate(s, costs).max_peak_memory <= 2 * 4 * 1.5 + 1e-9
    with pytest.raises(ValueError, match="costs.json"):
        hs.parse_stage_costs('{"stages": [{"f": 1, "i": 1, "w": 1, "speed": 2}]}', "costs.json")


def test_sim_result_fields():
    p, m = 4, 8
    s = hs.build("zb-h1", p, m)
    r = hs.simulate(s, hs.CostModel(comm=0.5))
    assert len(r.rank_busy) == len(r.rank_idle) == len(r.rank_span) == len(r.peak_memory) == p
    for k in range(p):
        assert r.rank_idle[k] == pytest.approx(r.makespan - r.rank_busy[k])
        assert r.rank_span[k] <= r.span + 1e-12
    assert r.work == pytest.approx(max(r.rank_busy))
    assert r.bubble_rate == pytest.approx((r.span - r.work) / r.span)
    assert r.idle_fraction == pytest.approx(sum(r.rank_idle) / (p * r.makespan))
    assert r.max_peak_memory == max(r.peak_memory)
    # Loop placement: one activation and one gradient per boundary per microbatch.
    assert r.comm_volume == hs.comm_volume(s) == 2 * (p - 1) * m
    t = r.timeline
    assert len(t.events) == sum(len(row) for row in s.actions) and t.num_ranks == p
    assert t.makespan() == pytest.approx(r.makespan)
    # The statistics of the timeline alone agree with the simulation.
    st = hs.timeline_stats(t)
    assert st.bubble_rate == pytest.approx(r.bubble_rate) and st.makespan == r.makespan
    assert "step time" in str(st)  # a timeline has no memory fields; still printable
    assert not hs.simulate(s, record_timeline=False).timeline.events
    j = json.loads(r.to_json("zb-h1"))
    assert j["name"] == "zb-h1" and j["comm_volume"] == r.comm_volume
    assert json.loads(hs.summary_json(r))["makespan"] == r.makespan
    assert "bubble rate" in hs.summary_text(r) and "SimResult(makespan=" in repr(r)


# ---------------------------------------------------------------------------
# Renderers


def test_renderers():
    p, m = 4, 8
    s = hs.build("zb-h1", p, m)
    r = hs.simulate(s)
    text = hs.render_ascii(r)
    rows = [line for line in text.splitlines() if line.startswith("rank ")]
    assert len(rows) == p and "F0" in rows[0] and "W7" in rows[0]
    assert hs.render_ascii(s) == text  # a schedule is simulated at unit costs
    assert "\x1b[" in hs.render_ascii(r, color=True)
    assert len(rows[0]) <= 100 + 20 and len(hs.render_ascii(r, max_width=100).splitlines()[1]) < len(rows[0]) + 1
    svg = hs.render_svg(r)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    two = hs.render_svg([r, hs.simulate(hs.build("1f1b", p, m))], width=800)
    assert ET.fromstring(two).get("width") == "800"
    trace = json.loads(hs.render_chrome_trace(r))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(r.timeline.events)
    assert {e["tid"] for e in xs} == set(range(p))
    # One time unit is one millisecond; trace times are microseconds.
    assert all(e["dur"] == pytest.approx(1000.0) for e in xs)
    # A measured timeline, built by hand.
    t = hs.Timeline(2, title="measured")
    t.add(0, "0F0", 0.0, 1.0)
    t.add(1, hs.Action("1F0"), 1.0, 2.5)
    t.add(1, "1B0", 2.5, 4.0)
    assert "measured" in hs.render_ascii(t) and len(t) == 3
    assert json.loads(hs.render_chrome_trace(t))["otherData"]["title"] == "measured"
    ET.fromstring(hs.render_svg(t))


def test_renderers_refuse_bad_timelines():
    with pytest.raises(ValueError, match="rank outside"):
        hs.render_ascii(hs.Timeline(1, [hs.Event(3, "0F0", 0, 1)]))
    with pytest.raises(ValueError, match="finite"):
        hs.render_svg(hs.Timeline(1, [hs.Event(0, "0F0", 0, float("nan"))]))
    with pytest.raises(ValueError, match="start <= end"):
        hs.render_chrome_trace(hs.Timeline(1, [hs.Event(0, "0F0", 2, 1)]))
    with pytest.raises(ValueError, match="rank outside"):
        hs.timeline_stats(hs.Timeline(1, [hs.Event(-1, "0F0", 0, 1)]))
    with pytest.raises(ValueError, match="max_width"):
        hs.render_ascii(hs.Timeline(1), max_width=0)
    with pytest.raises(TypeError):
        hs.render_ascii("zb-h1")
    with pytest.raises(TypeError):
        hs.render_svg(42)
    with pytest.raises(ValueError, match="record_timeline"):
        hs.render_ascii(hs.simulate(hs.build("1f1b", 2, 2), record_timeline=False))


# ---------------------------------------------------------------------------
# CSV


def test_csv_round_trip_for_every_generator(tmp_path):
    for name, s in built().items():
        for sched in (s, hs.lower(s)):
            text = hs.to_csv(sched)
            assert text.startswith("# hp-schedule,1\n")
            back = hs.from_csv(text)
            assert back == sched and hs.to_csv(back) == text, name
            assert back.actions == sched.actions and back.routes == sched.routes
    path = tmp_path / "zbv.csv"
    hs.write_csv(built()["zbv"], path)
    assert hs.read_csv(path) == built()["zbv"]
    assert hs.read_csv(str(path)).stage_rank == [0, 1, 2, 3, 3, 2, 1, 0]


def test_csv_plain_rows_and_strictness(tmp_path):
    # Plain rows (torch style): placement inferred from where the stages sit.
    s = hs.from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n")
    assert s.num_ranks == 2 and s.num_stages == 2 and s.num_microbatches == 2
    hs.validate(s)
    # The header must agree with the rows.
    with pytest.raises(ValueError, match=r"s\.csv: line 1 says 3 ranks but the file has 2 rows"):
        hs.from_csv("# ranks,3\n0F0,0B0\n1F0,1B0\n", "s.csv")
    with pytest.raises(ValueError, match=r"line 2 \(rank 0\): cannot parse action '0Q0'"):
        hs.from_csv("# ranks,1\n0Q0\n", "bad.csv")
    with pytest.raises(ValueError, match=r"\\x00"):
        hs.from_csv("0F\x000\n")
    with pytest.raises(ValueError, match="more than the limit"):
        hs.from_csv("#" * (hs.MAX_INPUT_BYTES + 1))
    with pytest.raises(ValueError, match="missing.csv"):
        hs.read_csv(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="not a regular file"):
        hs.read_csv(tmp_path)
    with pytest.raises(TypeError):
        hs.from_csv(None)


def hp_binary():
    path = os.path.join(ROOT, "build", "tools", "hp", "hp")
    return path if os.access(path, os.X_OK) else None


@pytest.mark.skipif(hp_binary() is None, reason="the hp CLI is not built in build/")
def test_csv_is_the_cli_csv(tmp_path):
    for name, extra in (("interleaved-zb", ["-v", "2"]), ("dualpipe", [])):
        out = tmp_path / f"{name}.csv"
        cmd = [hp_binary(), "schedule", "show", name, "-p", "4", "-m", "8", *extra,
               "--csv", str(out), "--no-color"]
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
        s = hs.build(name, 4, 8)
        assert out.read_text() == hs.to_csv(s), name
        assert hs.read_csv(out) == s


# ---------------------------------------------------------------------------
# Validation and hand-made schedules


def test_validate_rejects_broken_lists():
    s = hs.build("1f1b", 2, 2)
    rows = s.actions
    assert [str(a) for a in rows[1]] == ["1F0", "1B0", "1F1", "1B1"]
    broken = s.copy()
    broken.actions = [rows[0], rows[1][:-1]]  # rank 1 never runs 1B1
    with pytest.raises(ValueError, match="invalid schedule"):
        hs.validate(broken)
    with pytest.raises(ValueError, match="invalid schedule"):
        hs.simulate(broken)
    with pytest.raises(ValueError, match="invalid schedule"):
        hs.lower(broken)
    # Backward before forward on one rank: it waits for itself.
    swapped = s.copy()
    swapped.actions = [rows[0], [rows[1][1], rows[1][0], *rows[1][2:]]]
    with pytest.raises(ValueError, match="rank 1"):
        hs.validate(swapped)
    # Rank 0 waits for 1B0 before it sends microbatch 1; rank 1 wants
    # microbatch 1 before it runs 1B0: deadlock.
    dead = hs.Schedule(2, 2, ["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"])
    with pytest.raises(ValueError, match="deadlock"):
        hs.validate(dead)
    # A stage on the wrong rank.
    wrong = hs.Schedule(2, 1, ["0F0 0B0", "1F0 1B0"], stage_rank=[1, 0])
    with pytest.raises(ValueError, match="rank 0 action 0"):
        hs.validate(wrong)
    with pytest.raises(ValueError, match="already lowered"):
        hs.lower(hs.lower(s))


def test_schedule_objects():
    s = hs.build("zb-h1", 2, 2)
    assert repr(s) == "<Schedule 'zb-h1' ranks=2 stages=2 microbatches=2 chunks=2 routes=1 actions=12>"
    lines = str(s).splitlines()
    assert lines[-2].startswith("  rank 0: 0F0 0F1 ") and lines[-1].startswith("  rank 1: 1F0 ")
    assert all(isinstance(a, hs.Action) for row in s.actions for a in row)
    # Built from text rows; defaults give loop placement and one route.
    t = hs.Schedule(2, 2, [[str(a) for a in row] for row in s.actions], name="zb-h1")
    assert t == s and t.stage_rank == [0, 1] and t.routes == [[0, 1]]
    assert hs.Schedule(2, 2, [" ".join(map(str, row)) for row in s.actions], name="zb-h1") == s
    assert pickle.loads(pickle.dumps(s)) == s
    c = copy.deepcopy(s)
    c.name = "mine"
    assert c != s and s.name == "zb-h1"
    assert s != "zb-h1"
    # Fields return copies: change them by assigning.
    rows = s.actions
    rows[0].clear()
    assert s.actions[0]
    c.actions = rows
    assert c.actions[0] == []
    with pytest.raises(ValueError, match="stage_rank has 1 entries"):
        hs.Schedule(2, 2, s.actions, stage_rank=[0])
    with pytest.raises(ValueError, match="actions has 3 rows"):
        hs.Schedule(2, 2, [[], [], []], num_stages=2)
    with pytest.raises(TypeError):
        hs.Schedule(2, 2, "0F0 0B0")
    with pytest.raises(TypeError):
        hs.Schedule(2, 2, [[1, 2]])


def test_nonsense_fields_are_errors_not_crashes():
    s = hs.build("1f1b", 2, 2)
    for field, value in (
        ("stage_rank", [0]),
        ("stage_rank", [0, 7]),
        ("stage_chunk", [5, 5]),
        ("routes", [[0, 9]]),
        ("routes", []),
        ("microbatch_route", [0, 3]),
        ("num_ranks", 0),
        ("num_stages", 5),
        ("num_microbatches", 7),
    ):
        b = s.copy()
        setattr(b, field, value)
        for fn in (hs.validate, hs.simulate, hs.lower, hs.comm_volume):
            with pytest.raises(ValueError):
                fn(b)
        with pytest.raises(ValueError):
            b.stages_of_rank(0)
    b = s.copy()
    b.actions = [["0F0", "0F9", "0B0"], ["1F0"]]
    with pytest.raises(ValueError):
        hs.simulate(b)
    with pytest.raises(ValueError, match="at most 100000"):
        s.copy().num_stages = 10**7


def test_actions():
    a = hs.Action("2F0")
    assert (a.op, a.stage, a.microbatch) == (hs.Op.F, 2, 0) and a.is_compute and not a.is_comm
    assert a == hs.Action(hs.Op.F, 2, 0) and repr(a) == "Action('2F0')" and str(a) == "2F0"
    fb = hs.Action("3F1+5B0")
    assert fb == hs.Action.overlap(3, 1, 5, 0) and (fb.stage2, fb.microbatch2) == (5, 0)
    assert fb.halves == (hs.Action("3F1"), hs.Action("5B0")) and a.halves == (a,)
    led = hs.Action("5B0+3F1")  # the B half leads the pair
    assert led == hs.Action.overlap(3, 1, 5, 0, backward_first=True) and str(led) == "5B0+3F1"
    assert led.backward_first and not fb.backward_first and led != fb
    assert len({led, fb}) == 2 and pickle.loads(pickle.dumps(led)) == led
    assert hs.Action("0SEND_B2").is_comm and hs.Op.RECV_F.is_comm and hs.Op.W.is_compute
    assert len({hs.Action("1I3"), hs.Action.parse("1I3"), hs.Action("1W3")}) == 2
    assert pickle.loads(pickle.dumps(fb)) == fb and a != "2F0"
    with pytest.raises(ValueError, match="cannot parse action '2X0'"):
        hs.Action("2X0")
    with pytest.raises(ValueError, match="Action.overlap"):
        hs.Action(hs.Op.FB, 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        hs.Action(hs.Op.F, -1, 0)
    with pytest.raises(TypeError):
        hs.Action(hs.Op.F, "1", 0)
    with pytest.raises(AttributeError):
        a.stage = 3  # immutable


def test_builds_run_in_threads():
    # The generators release the GIL; results are deterministic.
    costs = hs.CostModel(f=1, b=1.3, w=0.6, comm=0.1)
    out = [None] * 3

    def run(i):
        out[i] = hs.build("zb-auto", 8, 24, costs=costs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out[0] == out[1] == out[2]


def test_recommend_ranks_every_schedule_under_a_memory_limit():
    # hp schedule recommend from Python: the rows within the limit come first,
    # each group by step time; the top one fits, runs as a CSV and is never
    # slower than a fixed schedule that fits.
    costs = hs.CostModel()
    rows, skipped = hs.recommend(4, 16, costs, mem_limit="0.5x")
    limit = hs.mem_limit_value("0.5x", 4, costs)
    assert rows and all(isinstance(r, hs.Recommendation) for r in rows)
    fits = [r.fits for r in rows]
    assert fits == sorted(fits, reverse=True)
    for r in rows:
        assert r.fits == (max(r.result.peak_memory) <= limit + 1e-9), r.name
    fitting = [r for r in rows if r.fits]
    assert fitting[0].name == "auto" or fitting[0].result.makespan <= min(
        r.result.makespan for r in fitting) + 1e-9
    assert [r.result.makespan for r in fitting] == sorted(r.result.makespan for r in fitting)
    assert "auto" in [r.name for r in fitting]
    hs.validate(hs.lower(fitting[0].schedule))
    assert all(isinstance(name, str) and why for name, why in skipped)
    with pytest.raises(ValueError, match="mem_limit must be a finite number"):
        hs.recommend(4, 16, costs, mem_limit=float("nan"))


def test_choose_deferred_w_is_the_two_simulations():
    # NOTE [Deferred W's where they lower the step]: the pairs without
    # deferred W's (ready turns under "auto" on the CPU) and with them
    # (fixed), the same numbers simulate() gives; chosen where the step
    # with them is the gain shorter.
    sched = hs.Schedule(2, 3, ["0F0 0F1 0F2 0B0 0B1 0B2", "1F0 1F1+1B0 1F2+1B1 1B2"])
    costs = hs.CostModel(f=1, b=2, w=1)
    costs.stage_inner = [hs.InnerComm(), hs.InnerComm(f_waits=1, f=2, i_waits=1, i=2)]
    without = hs.simulate(sched, costs, fb_overlap=True)
    with_ = hs.simulate(sched, costs, fb_overlap=True, defer_wgrad=True)
    c = hs.choose_deferred_w(sched, costs)
    assert (c.step_without, c.step_with) == (pytest.approx(without.makespan),
                                             pytest.approx(with_.makespan))
    assert (c.peak_without, c.peak_with) == (pytest.approx(without.max_peak_memory),
                                             pytest.approx(with_.max_peak_memory))
    assert c.defer == (c.step_with <= 0.97 * c.step_without)
    # The C++ Simulate.DeferredWsAreChosenWhereTheyShortenTheStep's case: 23 against 21.5.
    assert (c.step_without, c.step_with, c.defer) == (pytest.approx(23), pytest.approx(21.5), True)
    assert hs.choose_deferred_w(sched, costs, gain=-1).defer
    assert not hs.choose_deferred_w(sched, costs, gain=1).defer
    # On a device the turns are fixed both ways.
    fixed = hs.simulate(sched, costs, fb_overlap=True, pair_turns="fixed")
    assert hs.choose_deferred_w(sched, costs, cpu=False).step_without == pytest.approx(
        fixed.makespan)
    # Ready turns with recompute take no deferred W's: nothing simulated.
    refused = hs.choose_deferred_w(sched, costs, pair_turns="ready", recompute=True)
    assert not refused.defer and refused.step_with == 0
    with pytest.raises(ValueError, match="from -1 to 1, got 1.5"):
        hs.choose_deferred_w(sched, costs, gain=1.5)
    with pytest.raises(ValueError, match="'auto', 'ready' or 'fixed'"):
        hs.choose_deferred_w(sched, costs, pair_turns="soon")
