"""SparDL's team count from the link's costs (``spardl.choose``, §III-D)
and the planner that puts it into a plan.

The hand-computed cases price ``SparDL.steps`` by the α-β lines (Eq. 5-10
with this implementation's messages): ppermute α_p = 10 µs, β_p = 1 ns/B;
all_gather measured on K₀ = 2 (one message: a = 20 µs, b = 1 ns/B); slots
of 8 bytes (float32 value, int32 index), block b = 2.
"""

import dataclasses

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
import jax
import pytest

import jaxfuse
from jaxfuse import collectives
from jaxfuse import plans as plan_lib
from jaxfuse.collectives import spardl
from jaxfuse.planning.costs import Costs
from jaxfuse.planning.costs import LinearCost


def _costs(ppermute=(1e-5, 1e-9), allgather=(2e-5, 1e-9), workers=2):
  lines = {"allgather": LinearCost(*allgather), "psum": LinearCost(*allgather)}
  if ppermute is not None:
    lines["ppermute"] = LinearCost(*ppermute)
  return Costs(lines, LinearCost(0.0, 0.0), (), workers=workers)


def _units(size, slots):
  return [plan_lib.Unit((0,), size, slots, slots / size, "topk", "float32")]


def _time(teams, units, k, costs):
  steps = spardl.SparDL(teams=teams).steps(units, k, plan_lib.Settings())
  return costs.steps_time(steps, k)


def test_r_sag_on_eight_workers_by_hand():
  """K = 8, N = 1000, C = 100: m_1 = 25, m_2 = 50, m_4 = 100 slots.
  T = 1: SRS rounds of 4, 2, 1 blocks (800, 400, 200 B), all_gather of
  200 B: 3·10 µs + 1400 ns + 7·(20 µs + 200 ns) = 172.8 µs.
  T = 2: SRS 2, 1 blocks of 50 (800, 400 B), one R-SAG round (400 B),
  all_gather of 25 slots: 30 µs + 1600 ns + 141.4 µs = 173.0 µs.
  T = 4: SRS 1 block of 100 (800 B), two R-SAG rounds (800 B each):
  30 µs + 2400 ns + 141.4 µs = 173.8 µs. Teams add bandwidth and, with
  the all_gather over all K, no latency is saved: T = 1."""
  units, costs = _units(1000, 100), _costs()
  assert _time(1, units, 8, costs) == pytest.approx(172.8e-6, rel=1e-12)
  assert _time(2, units, 8, costs) == pytest.approx(173.0e-6, rel=1e-12)
  assert _time(4, units, 8, costs) == pytest.approx(173.8e-6, rel=1e-12)
  assert spardl.choose(8, units, costs) == spardl.SparDL(teams=1)


def test_b_sag_ties_go_to_the_fewest_teams():
  """K = 6, N = 600, C = 60. T = 1: m = 20, SRS bags of 2, 2, 1 blocks
  (320, 320, 160 B), all_gather of 160 B: 30 µs + 800 ns + 5·(20 µs +
  160 ns) = 131.6 µs. T = 3 (B-SAG): m = 60, one SRS block (480 B), Bruck
  rounds of h = m/3 = 20 slots (160 B, 160 B), all_gather of 20 slots:
  the same 131.6 µs. T = 2 (R-SAG): m = 40, SRS 1, 1 blocks (320, 320 B),
  one R-SAG round (320 B): 30 µs + 960 ns + 100.8 µs = 131.76 µs. The tie
  of T = 1 and T = 3 goes to T = 1 (teams drop more in merges)."""
  units, costs = _units(600, 60), _costs()
  assert _time(1, units, 6, costs) == pytest.approx(131.6e-6, rel=1e-12)
  assert _time(3, units, 6, costs) == pytest.approx(131.6e-6, rel=1e-12)
  assert _time(2, units, 6, costs) == pytest.approx(131.76e-6, rel=1e-12)
  assert spardl.choose(6, units, costs) == spardl.SparDL(teams=1)
  assert spardl.choose(6, units, costs, spardl.SparDL(teams=3, block=4.0)
                       ) == spardl.SparDL(teams=1, block=4.0)


def test_legal_teams_by_hand():
  assert spardl.legal_teams(1) == (1,)
  assert spardl.legal_teams(2) == (1,)
  assert spardl.legal_teams(8) == (1, 2, 4)
  assert spardl.legal_teams(12) == (1, 2, 3, 4, 6)
  assert spardl.legal_teams(7) == (1,)


@pytest.mark.parametrize("k,units,match", [
    (0, _units(100, 10), "num_workers=0"),
    (2.5, _units(100, 10), "num_workers=2.5"),
    (4, [], "without units")])
def test_choose_refuses_what_it_cannot_price(k, units, match):
  with pytest.raises(collectives.SchemeError, match=match):
    spardl.choose(k, units, _costs())


_line = st.tuples(st.floats(0, 1e-3), st.floats(0, 1e-8))


@hsettings(max_examples=60, deadline=None)
@given(k=st.integers(1, 24), size=st.integers(1, 5000),
       share=st.floats(0.001, 1.0), block=st.sampled_from([1.0, 2.0, 4.0]),
       ppermute=st.one_of(st.none(), _line), allgather=_line,
       workers=st.integers(2, 16))
def test_the_choice_is_legal_and_least_of_all_legal_teams(
    k, size, share, block, ppermute, allgather, workers):
  """Over every legal T, the chosen one has the least modelled time, the
  fewest teams among equals, and keeps the caller's block. And T = 1 is
  always among the least: with the final all_gather over all K workers,
  T teams gather m_T/T ≥ m_1 slots each, and their ppermutes carry at
  least (K−1)·m_1 slots in at least ⌈log₂K⌉ rounds."""
  units = _units(size, max(1, int(share * size)))
  costs = _costs(ppermute, allgather, workers)
  got = spardl.choose(k, units, costs, spardl.SparDL(block=block))
  assert got.block == block and got.teams in spardl.legal_teams(k)
  got.check("test", k, plan_lib.Settings())          # no SchemeError
  times = {t: costs.steps_time(dataclasses.replace(got, teams=t).steps(
      units, k, plan_lib.Settings()), k) for t in spardl.legal_teams(k)}
  least = min(times.values())
  tie = lambda t: times[t] <= least * (1 + 2 * spardl.TIE)
  assert tie(got.teams) and tie(1)        # least up to the sums' rounding
  assert all(times[t] > times[got.teams] * (1 - spardl.TIE)
             for t in spardl.legal_teams(k) if t < got.teams)


_PARAMS = [jax.ShapeDtypeStruct((256, 256), "float32") for _ in range(3)]
_SLOW = Costs({"allgather": LinearCost(1e-5, 1e-9),
               "psum": LinearCost(1e-5, 1e-9)}, LinearCost(0.0, 0.0),
              (1e-4,) * 3, overlap=0.0, workers=2)


def _spardl_buckets(plan):
  got = [b for b in plan.buckets if b.collective == "spardl"]
  assert got, [b.collective for b in plan.buckets]
  return got


def test_auto_puts_the_chosen_teams_into_the_plan(monkeypatch):
  """64 workers on a slow link: auto picks SparDL, configured by
  ``spardl.choose`` for K = 64 and the costs (T = 1 here: the hand cases);
  a choice of other teams goes into the plan, and its JSON, as chosen."""
  plan = jaxfuse.plan(_PARAMS, density=0.01, strategy="auto", costs=_SLOW,
                      num_workers=64)
  assert all(b.scheme == spardl.SparDL(teams=1, block=2.0)
             for b in _spardl_buckets(plan))
  calls = []

  def fake(num_workers, units, costs, config=None):
    calls.append((num_workers, sum(u.capacity for u in units), costs))
    return spardl.SparDL(teams=4, block=config.block)
  monkeypatch.setattr(spardl, "choose", fake)
  plan = jaxfuse.plan(_PARAMS, density=0.01, strategy="auto", costs=_SLOW,
                      num_workers=64)
  buckets = _spardl_buckets(plan)
  assert all(b.scheme == spardl.SparDL(teams=4) for b in buckets)
  assert calls and all(k == 64 and c is _SLOW for k, _, c in calls)
  back = plan_lib.Plan.from_json(plan.to_json())
  assert [b.scheme for b in back.buckets] == [b.scheme for b in plan.buckets]


def test_a_spardl_the_user_configured_keeps_its_teams(monkeypatch):
  monkeypatch.setattr(spardl, "choose", lambda *a, **k: pytest.fail(
      "choose ran for a configured SparDL"))
  given_ = (collectives.AllGather(), collectives.SparDL(teams=2, block=4.0))
  plan = jaxfuse.plan(_PARAMS, density=0.01, strategy="auto", costs=_SLOW,
                      num_workers=64, collective=given_)
  assert all(b.scheme == collectives.SparDL(teams=2, block=4.0)
             for b in _spardl_buckets(plan))
