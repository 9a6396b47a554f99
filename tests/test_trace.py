"""The measured timeline (``jaxfuse.planning.trace``) on a hand-written trace
whose busy, overlapped and hidden times are worked out below by hand; its
errors; a real CPU profile; and ``jaxfuse show --measured``."""

import gzip
import lzma
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import jaxfuse
from jaxfuse.planning import cli
from jaxfuse.planning import trace

from _harness import cpu_env

REPO = pathlib.Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
US = 1e-6  # the trace's unit, in seconds

GPU0, GPU1, HOST = 1, 2, 701
COMPUTE_STREAM, NCCL_STREAM, COPY_STREAM, XLA_OPS = 7, 13, 14, 99
AG = "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL"


def meta(pid, name, tid=None):
  e = {"ph": "M", "pid": pid, "name": "process_name" if tid is None else
       "thread_name", "args": {"name": name}}
  if tid is not None:
    e["tid"] = tid
  return e


def kernel(pid, tid, name, start_us, end_us, **args):
  return {"ph": "X", "pid": pid, "tid": tid, "ts": start_us,
          "dur": end_us - start_us, "name": name, "args": args}


def marker(step, start_us, end_us):
  return {"ph": "X", "pid": HOST, "tid": 5, "ts": start_us,
          "dur": end_us - start_us, "name": "train",
          "args": {"step_num": str(step)}}


# The two steps, in µs on the trace's clock:
#
#  step 0, marker [1000, 2000)
#   Stream #7   fusion.1 [1100,1300) fusion.2 [1300,1500) fusion.3 [1600,1700)
#   Stream #14  MemcpyD2D [1450,1550)                  (compute, another stream)
#   Stream #13  AllGather [1400,1650)                  (link)
#   C = [1100,1550) ∪ [1600,1700) -> 450 + 100 = 550
#   L = [1400,1650)               -> 250
#   C ∩ L = [1400,1550) ∪ [1600,1650) -> 150 + 50 = 200
#   hidden = 200 / 250 = 0.8, exposed = 50, span = 1700 - 1100 = 600
#
#  step 1, marker [2000, 3000)
#   Stream #7   fusion.1 [2100,2400);  Stream #13  AllReduce [2400,2600)
#   C = 300, L = 200, C ∩ L = 0 (they touch, no more): hidden 0, span 500
#
#  outside every marker (left out): a warm-up fusion [500,600) and an
#  all-reduce [3100,3200). The "XLA Ops" row repeats the work and is not a
#  stream, so its [1000,1800) must not count; GPU 1 has its own kernel.
STEP0 = [("compute", 0, 200, "fusion.1"), ("compute", 200, 400, "fusion.2"),
         ("link", 300, 550, AG), ("compute", 350, 450, "MemcpyD2D"),
         ("compute", 500, 600, "fusion.3")]
STEP1 = [("compute", 0, 300, "fusion.1"), ("link", 300, 500, AR)]


def events(markers=True):
  out = [
      meta(GPU0, "/device:GPU:0"),
      meta(GPU0, "Stream #7(Kernel)", COMPUTE_STREAM),
      meta(GPU0, "Stream #13(Kernel)", NCCL_STREAM),
      meta(GPU0, "Stream #14(MemcpyD2D)", COPY_STREAM),
      meta(GPU0, "XLA Ops", XLA_OPS),
      meta(GPU1, "/device:GPU:1"),
      meta(GPU1, "Stream #7(Kernel)", COMPUTE_STREAM),
      meta(HOST, "/host:CPU"),
      meta(HOST, "python", 5),
      {"ph": "M", "pid": GPU0, "name": "process_sort_index",
       "args": {"sort_index": 1}},
      kernel(GPU0, COMPUTE_STREAM, "fusion.0", 500, 600),
      kernel(GPU0, COMPUTE_STREAM, "fusion.1", 1100, 1300, hlo_op="fusion.1"),
      kernel(GPU0, COMPUTE_STREAM, "fusion.2", 1300, 1500),
      kernel(GPU0, COPY_STREAM, "MemcpyD2D", 1450, 1550),
      kernel(GPU0, NCCL_STREAM, AG, 1400, 1650),
      kernel(GPU0, COMPUTE_STREAM, "fusion.3", 1600, 1700),
      kernel(GPU0, XLA_OPS, "fusion", 1000, 1800),
      kernel(GPU0, COMPUTE_STREAM, "fusion.1", 2100, 2400),
      kernel(GPU0, NCCL_STREAM, AR, 2400, 2600),
      kernel(GPU0, NCCL_STREAM, AR, 3100, 3200),
      kernel(GPU1, COMPUTE_STREAM, "fusion.9", 1120, 1180),
      {"ph": "X", "pid": HOST, "tid": 5, "ts": 900, "dur": 50,
       "name": "PjitFunction(step)"},
      {"ph": "C", "pid": GPU0, "ts": 1000, "name": "memory", "args": {"x": 1}},
      {},
  ]
  if markers:
    out += [marker(0, 1000, 2000), marker(1, 2000, 3000)]
  return out


def write_trace(path, evts, gz=True, bare_list=False, xz=False):
  body = evts if bare_list else {"displayTimeUnit": "ns", "traceEvents": evts}
  data = json.dumps(body).encode()
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(lzma.compress(data) if xz else
                   gzip.compress(data) if gz else data)
  return path


@pytest.fixture
def log_dir(tmp_path):
  """A jax.profiler log_dir: <log_dir>/plugins/profile/<run>/..."""
  d = tmp_path / "log"
  write_trace(d / "plugins/profile/2026_01_01_00_00_00/perfetto_trace.json.gz",
              events())
  return d


def rows(step):
  return [(row, round(s / US, 6), round(e / US, 6), n)
          for row, s, e, n in step.kernels]


def test_rows_of_each_step_from_the_streams_only(log_dir):
  measured = trace.read_trace(log_dir)
  assert measured.device == "/device:GPU:0"
  assert measured.devices == ("/device:GPU:0", "/device:GPU:1")
  assert measured.markers == ("train",)
  assert [s.step_num for s in measured.steps] == [0, 1]
  assert rows(measured.steps[0]) == STEP0
  assert rows(measured.steps[1]) == STEP1
  # origins: each step's first kernel on the trace's clock
  assert measured.steps[0].origin == pytest.approx(1100 * US)
  assert measured.steps[1].origin == pytest.approx(2100 * US)
  assert measured.steps[0].wall == pytest.approx(1000 * US)


def test_busy_overlap_hidden_worked_by_hand(log_dir):
  s0, s1 = trace.read_trace(log_dir).steps
  assert s0.compute_busy == pytest.approx(550 * US)
  assert s0.link_busy == pytest.approx(250 * US)
  assert s0.overlapped == pytest.approx(200 * US)
  assert s0.exposed == pytest.approx(50 * US)
  assert s0.hidden == pytest.approx(0.8)
  assert s0.span == pytest.approx(600 * US)
  assert [(round(a / US, 6), round(b / US, 6)) for a, b in s0.overlaps] == [
      (300, 450), (500, 550)]
  assert s1.compute_busy == pytest.approx(300 * US)
  assert s1.link_busy == pytest.approx(200 * US)
  assert s1.overlapped == 0 and s1.overlaps == ()
  assert s1.hidden == 0 and s1.span == pytest.approx(500 * US)


def test_totals_and_the_step_drawn(log_dir):
  measured = trace.read_trace(log_dir)
  assert measured.total("compute_busy") == pytest.approx(850 * US)
  assert measured.total("link_busy") == pytest.approx(450 * US)
  assert measured.total("overlapped") == pytest.approx(200 * US)
  assert measured.hidden == pytest.approx(200 / 450)
  # spans 600 and 500: the (lower) median is step 1's
  assert measured.step().step_num == 1
  assert measured.step(0) is measured.steps[0]
  with pytest.raises(trace.TraceError, match=r"no step 7 .*\[0, 1\]"):
    measured.step(7)
  d = measured.to_dict()
  assert json.loads(json.dumps(d))["steps"][0]["hidden"] == pytest.approx(0.8)
  assert d["link_busy"] == pytest.approx(450 * US)


def test_interval_arithmetic():
  assert trace.union([(3, 4), (0, 2), (1, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
  assert trace.length([(0, 2), (1, 3), (10, 11)]) == 4
  assert trace.intersection([(0, 2), (4, 8)], [(1, 5), (7, 9)]) == [
      (1, 2), (4, 5), (7, 8)]
  assert trace.intersection([(0, 1)], [(1, 2)]) == []


def test_another_gpu_and_no_markers(tmp_path, log_dir):
  one = trace.read_trace(log_dir, device=1)
  assert one.device == "/device:GPU:1"
  assert [rows(s) for s in one.steps] == [[("compute", 0, 60, "fusion.9")]]
  # without markers the whole trace is one step, from the first kernel at
  # 500 to the last end at 3200, warm-up included; plain JSON, bare list
  path = write_trace(tmp_path / "t.json", events(markers=False), gz=False,
                     bare_list=True)
  (whole,) = trace.read_trace(path).steps
  assert whole.step_num is None and whole.wall is None
  assert whole.origin == pytest.approx(500 * US)
  assert whole.span == pytest.approx(2700 * US)
  # C: 100 (warm-up) + 550 + 300; L: 250 + 200 + 100; C ∩ L as in step 0
  assert whole.compute_busy == pytest.approx(950 * US)
  assert whole.link_busy == pytest.approx(550 * US)
  assert whole.overlapped == pytest.approx(200 * US)


def test_a_directory_gives_its_newest_trace(tmp_path, log_dir):
  newer = log_dir / "plugins/profile/2026_01_02_00_00_00/perfetto_trace.json.gz"
  write_trace(newer, [e for e in events() if e.get("pid") != GPU1])
  os.utime(newer, (2e9, 2e9))
  assert trace.find_trace_file(log_dir) == newer
  assert trace.read_trace(log_dir).devices == ("/device:GPU:0",)
  # only the host's <host>.trace.json.gz (created without perfetto): read it
  alone = tmp_path / "other/plugins/profile/run/vm.trace.json.gz"
  write_trace(alone, events())
  assert trace.find_trace_file(tmp_path / "other") == alone


def test_an_xz_trace_reads_as_its_gzip(tmp_path):
  """The repository stores its traces as .json.xz: the same steps, to
  the bit, as the gzip JAX wrote."""
  gz = trace.read_trace(write_trace(tmp_path / "t.json.gz", events()))
  xz = trace.read_trace(write_trace(tmp_path / "t.json.xz", events(),
                                    xz=True))
  assert [rows(s) for s in xz.steps] == [rows(s) for s in gz.steps]
  assert [s.hidden for s in xz.steps] == [s.hidden for s in gz.steps]
  assert len(xz.steps) == 2


def test_errors_say_what_to_do(tmp_path, log_dir):
  cpu_only = [e for e in events() if e.get("pid") == HOST]
  path = write_trace(tmp_path / "cpu.json.gz", cpu_only)
  with pytest.raises(trace.TraceError, match=r"cpu\.json\.gz: no GPU device "
                     r"events \(processes in the trace: /host:CPU\).*GPUs"):
    trace.read_trace(path)
  with pytest.raises(trace.TraceError, match=r"missing: no such file or "
                     r"directory; record one with jax\.profiler\.trace"):
    trace.read_trace(tmp_path / "missing")
  (tmp_path / "empty").mkdir()
  with pytest.raises(trace.TraceError, match="no perfetto_trace.json.gz"):
    trace.read_trace(tmp_path / "empty")
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(trace.TraceError, match="bad.json: not a JSON trace"):
    trace.read_trace(bad)
  cut = tmp_path / "cut.json.xz"        # an xz file cut short
  cut.write_bytes(lzma.compress(b'{"traceEvents": []}' * 50)[:40])
  with pytest.raises(trace.TraceError, match="cut.json.xz: not a JSON trace"):
    trace.read_trace(cut)
  other = write_trace(tmp_path / "other.json", {"format": "x"}, gz=False,
                      bare_list=True)
  with pytest.raises(trace.TraceError, match="no 'traceEvents' list"):
    trace.read_trace(other)
  with pytest.raises(trace.TraceError, match=r"no /device:GPU:3; the trace "
                     "has /device:GPU:0, /device:GPU:1"):
    trace.read_trace(log_dir, device=3)
  with pytest.raises(trace.TraceError, match="no step markers named 'eval'"):
    trace.read_trace(log_dir, step_name="eval")
  no_kernels = [e for e in events() if e.get("ph") != "X"
                or e.get("pid") == HOST]
  with pytest.raises(trace.TraceError, match="no kernel events on its "
                     "streams"):
    trace.read_trace(write_trace(tmp_path / "nok.json.gz", no_kernels))
  late = [e for e in events() if e.get("name") != "train"] + [
      marker(0, 10, 20), marker(1, 20, 30)]
  with pytest.raises(trace.TraceError, match="none of the 2 step markers "
                     "holds a kernel.*block on each step"):
    trace.read_trace(write_trace(tmp_path / "late.json.gz", late))


def test_a_real_cpu_profile_has_no_device_events(tmp_path):
  """jax.profiler on CPU: the file is where JAX says, its step markers are
  host events with step_num, and there are no GPU kernels to read."""
  f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
  # on the CPU even in a GPU run (the step runs where its input lives)
  x = jax.device_put(jnp.ones((64, 64)), jax.devices("cpu")[0])
  f(x).block_until_ready()
  with jax.profiler.trace(tmp_path, create_perfetto_trace=True):
    for i in range(2):
      with jax.profiler.StepTraceAnnotation("train", step_num=i):
        f(x).block_until_ready()
  (path,) = tmp_path.glob("plugins/profile/*/perfetto_trace.json.gz")
  assert trace.find_trace_file(tmp_path) == path
  steps = [e for e in trace.load_events(path) if e.get("name") == "train"]
  assert [e["args"]["step_num"] for e in steps] == ["0", "1"]
  # with a GPU present (a GPU run) its device is in the profile, idle
  idle = ("no GPU device events.*/host:CPU" if jax.default_backend() == "cpu"
          else "/device:GPU:0 has no kernel events")
  with pytest.raises(trace.TraceError, match=idle):
    trace.read_trace(tmp_path)


@pytest.fixture
def plan_and_costs(tmp_path):
  from jaxfuse.planning.costs import Costs, LinearCost
  plan = jaxfuse.plan([jax.ShapeDtypeStruct((n,), "float32")
                       for n in (40000, 300, 90000)], strategy="layerwise")
  plan.save(tmp_path / "plan.json")
  Costs({"allgather": LinearCost(1e-5, 1e-9), "psum": LinearCost(1e-5, 2e-9)},
        LinearCost(1e-6, 1e-9), (1e-4,) * 3, overlap=0.5,
        forward=1e-4).save(tmp_path / "costs.json")
  return str(tmp_path / "plan.json"), str(tmp_path / "costs.json")


def test_show_measured_draws_and_prints(tmp_path, log_dir, plan_and_costs,
                                        capsys):
  plan, costs = plan_and_costs
  both, alone = tmp_path / "both.png", tmp_path / "alone.png"
  assert cli.main(["show", plan, "--measured", str(log_dir), "--costs",
                   costs, "-o", str(both)]) == 0
  out = capsys.readouterr().out
  assert "/device:GPU:0, 2 steps marked 'train'" in out
  table = {l.split()[0]: l.split() for l in out.splitlines() if l.strip()}
  # span, compute busy, link busy, overlapped, exposed, compute waited
  assert table["0"] == ["0", "0.600", "0.550", "0.250", "0.200", "0.050",
                        "0.000", "80%"]
  assert table["1"] == ["1", "0.500", "0.300", "0.200", "0.000", "0.200",
                        "0.000", "0%"]
  # the drawn step's link kernels: the all-reduce after the compute
  assert "link kernels of step 1" in out
  assert table["0:"][-5:] == ["0.300", "0.500", "0.200", "0.000", "0.000"]
  assert table["sum"][-1] == "44%"  # 200 / 450
  assert "measured hidden 44%" in out and "(step 1 drawn)" in out
  assert "simulated" in out
  # The simulator again at the trace's η: 200/450 of the link time hid,
  # a share 200/450 · G / H of what the ideal schedule hides (the costs say
  # 0.5).
  from jaxfuse.planning import costs as costs_lib, simulate
  plan_, costs_ = jaxfuse.Plan.load(plan), costs_lib.Costs.load(costs)
  ideal = simulate.simulate(plan_, costs_.replace(overlap=1.0))
  eta = min(1.0, 200 / 450 * ideal.communication / ideal.hidden)
  assert 0 < eta <= 1 and ideal.hidden < ideal.communication
  again = simulate.simulate(plan_, costs_.replace(overlap=eta)).iteration
  assert (f"with η = {eta:.2f} (this trace's share of what the ideal "
          f"schedule hides) the simulator predicts a step of "
          f"{again * 1e3:.3f} ms") in out
  assert cli.main(["show", plan, "--measured", str(log_dir), "--step", "0",
                   "-o", str(alone)]) == 0
  assert "(step 0 drawn)" in capsys.readouterr().out
  for png in (both, alone):
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
  # both charts in one figure: taller than the measured one alone
  height = lambda p: int.from_bytes(p.read_bytes()[20:24], "big")
  assert height(both) > 1.5 * height(alone)


def test_show_measured_errors(tmp_path, log_dir, plan_and_costs, capsys):
  plan, _ = plan_and_costs
  for argv, message in (
      (["--measured", str(tmp_path / "nope")], "--measured: "),
      (["--measured", str(log_dir), "--device", "4"], "no /device:GPU:4"),
      (["--measured", str(log_dir), "--step", "9"], "no step 9"),
      (["--step", "1"], "add --measured"),
      (["-o", str(tmp_path / "x.png")], "or --measured TRACE")):
    assert cli.main(["show", plan, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_show_measured_without_a_chart_needs_no_matplotlib(log_dir,
                                                           plan_and_costs):
  """Reading a trace and printing its table import no plotting library."""
  plan, _ = plan_and_costs
  code = ("import sys; from jaxfuse.planning import cli; "
          f"code = cli.main(['show', {plan!r}, '--measured', "
          f"{str(log_dir)!r}]); "
          "assert 'matplotlib' not in sys.modules, 'matplotlib imported'; "
          "sys.exit(code)")
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cpu_env(1),
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert "measured hidden 44%" in r.stdout


DATA = REPO / "tests" / "data"


def _raw_nccl_kernels(path):
  """Independently of ``trace``: (ts, dur, name) of GPU 0's NCCL kernels
  and the step markers' (ts, dur), straight from the JSON."""
  events = json.load(gzip.open(path))["traceEvents"]
  gpu0 = {e["pid"] for e in events if e.get("name") == "process_name"
          and e["args"]["name"] == "/device:GPU:0"}
  nccl = [(e["ts"], e["dur"], e["name"]) for e in events
          if e.get("ph") == "X" and e["pid"] in gpu0 and "nccl" in e["name"]]
  steps = sorted((e["ts"], e["dur"]) for e in events
                 if "step_num" in (e.get("args") or {}))
  return nccl, steps


@pytest.mark.parametrize("name, gathers, reduces, hidden", [
    ("send_early", 5, 0, (0.75, 1.0)), ("default", 5, 1, (0.0, 0.1))])
def test_a_real_gpu_trace(name, gathers, reduces, hidden):
  """Profiles of gpt2-small's sparse step on 2 × H200 over sockets (3 steps,
  trimmed to GPU 0 and the step markers; benchmarks/results/
  overlap_2026-11-28). Their compiled programs hold 5 sparse all-gathers,
  and the plain step one all-reduce (its dense psums, combined); under
  send_early those psums are fused kernels, not NCCL. Its schedule starts
  the all-gathers inside the backward, the plain one after it."""
  path = DATA / f"trace_{name}_gpt2_2xH200_socket.json.gz"
  measured = trace.read_trace(path)
  assert measured.device == "/device:GPU:0"
  assert [s.step_num for s in measured.steps] == [0, 1, 2]
  nccl, markers = _raw_nccl_kernels(path)
  for s, (t0, dur) in zip(measured.steps, markers):
    link = [k for k in s.kernels if k[0] == trace.LINK]
    assert sum("AllGather" in k[3] for k in link) == gathers
    assert sum("AllReduce" in k[3] for k in link) == reduces
    raw = [n for n in nccl if t0 <= n[0] <= t0 + dur]
    assert len(raw) == len(link)
    # One NCCL stream, kernels one after another: busy = Σ durations.
    assert s.link_busy == pytest.approx(sum(n[1] for n in raw) * US,
                                        rel=1e-6)
    assert hidden[0] <= s.hidden <= hidden[1]
    assert s.overlapped <= min(s.link_busy, s.compute_busy)


def test_compute_kernels_beside_the_link_when_most_of_it_overlaps():
  # link 0–150 µs; a 200 µs kernel overlapping 150 of it is beside, one
  # overlapping exactly half is not, one after the link is apart.
  step = trace.measure([
      (trace.LINK, 0.0, 150e-6, "ncclKernel_AllGather"),
      (trace.COMPUTE, 0.0, 200e-6, "gemm_a"),
      (trace.COMPUTE, 100e-6, 200e-6, "fusion.3"),
      (trace.COMPUTE, 300e-6, 310e-6, "fusion.4")])
  got = {name: (round(seconds * 1e6, 6), beside)
         for name, seconds, beside in trace.compute_kernels(step)}
  assert got == {"gemm_a": (200.0, True), "fusion.3": (100.0, False),
                 "fusion.4": (10.0, False)}


def test_link_kernels_name_where_the_compute_waited_for_them():
  # compute [0, 100) then idle until 410, 10 µs after the first link
  # kernel [50, 400) ended: it waited 310 µs for it (from 100). The second
  # link kernel [420, 450) runs beside compute [410, 500): no wait. Compute
  # idle [500, 700) ends long after the third [520, 560): no wait either.
  step = trace.measure([
      (trace.COMPUTE, 0.0, 100 * US, "fusion.1"),
      (trace.LINK, 50 * US, 400 * US, AG),
      (trace.COMPUTE, 410 * US, 500 * US, "fusion.2"),
      (trace.LINK, 420 * US, 450 * US, AG),
      (trace.LINK, 520 * US, 560 * US, AG),
      (trace.COMPUTE, 700 * US, 710 * US, "fusion.3")])
  got = [(round(k.start / US), round(k.end / US), round(k.under_compute / US),
          round(k.compute_waited / US)) for k in trace.link_kernels(step)]
  assert got == [(50, 400, 50, 310), (420, 450, 30, 0), (520, 560, 0, 0)]
  assert step.compute_waited == pytest.approx(310 * US)
  assert step.to_dict()["compute_waited"] == pytest.approx(310 * US)
