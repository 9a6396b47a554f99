"""``benchmarks/kernels.py kernel-slowdown``: per kernel family, the time the
calls beside NCCL's kernels lose against the one-GPU step."""

import json

import pytest

from jaxfuse.planning import trace

from _harness import repo_modules

US = 1e-6
CUBLAS = ("sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x128x32_"
          "warpgroupsize1x1x1_execute_segment_k_on_kernel__5x_cublas")


@pytest.fixture(scope="module")
def ks():
  with repo_modules("benchmarks/tools", "kernel_slowdown") as module:
    yield module


def _step(*kernels):
  return trace.measure([(row, a * US, b * US, name)
                        for row, a, b, name in kernels])


# One GPU: two calls of the product (100 µs each), one fusion, one other
# product; each step alike.
ONE = [_step((trace.COMPUTE, 0, 100, CUBLAS),
             (trace.COMPUTE, 100, 200, CUBLAS),
             (trace.COMPUTE, 200, 210, "loop_add_fusion.3"),
             (trace.COMPUTE, 210, 260, "gemm_b"))] * 2
# Two GPUs, step 1: the first product call beside the link and twice as
# slow (a second wave), the second apart and as fast; the fusion under
# another number; "gemm_b" now twice (another program), both beside.
# Step 2: both product calls apart.
TWO = [_step((trace.LINK, 0, 250, "ncclDevKernel_AllGather"),
             (trace.COMPUTE, 0, 200, CUBLAS),
             (trace.COMPUTE, 300, 400, CUBLAS),
             (trace.COMPUTE, 400, 412, "loop_add_fusion_17"),
             (trace.COMPUTE, 200, 240, "gemm_b"),
             (trace.COMPUTE, 240, 280, "gemm_b")),
       _step((trace.COMPUTE, 0, 100, CUBLAS),
             (trace.COMPUTE, 100, 200, CUBLAS),
             (trace.COMPUTE, 200, 212, "loop_add_fusion.9"),
             (trace.COMPUTE, 212, 262, "gemm_b"))]


def test_family_drops_xla_numbers_only(ks):
  assert ks.family("loop_add_fusion.3") == "loop_add_fusion"
  assert ks.family("loop_add_fusion_17") == "loop_add_fusion"
  assert ks.family("gemm_fusion_dot.414.1") == "gemm_fusion_dot"
  assert ks.family(CUBLAS) == CUBLAS
  assert ks.short(CUBLAS) == ("cuBLAS nt 128x128x32 f32f32_tf32f32_f32 "
                              "segment_k_on")
  assert ks.short("fusion") == "fusion"


def test_lost_is_the_calls_beside_times_their_slowdown(ks):
  rows = {r["family"]: r for r in ks.slowdown(ONE, TWO)}
  product = rows[CUBLAS]
  assert product["n1"] == 2 and product["t1"] == pytest.approx(100 * US)
  # per step: 1.5 calls apart (100 µs), 0.5 beside (200 µs)
  assert product["n_apart"] == pytest.approx(1.5)
  assert product["t_apart"] == pytest.approx(100 * US)
  assert product["n_beside"] == pytest.approx(0.5)
  assert product["t_beside"] == pytest.approx(200 * US)
  assert product["lost"] == pytest.approx(0.5 * 100 * US)
  # no call beside the link: nothing lost to name
  assert rows["loop_add_fusion"]["lost"] is None
  assert rows["loop_add_fusion"]["t_apart"] == pytest.approx(12 * US)
  # 1 call a step on one GPU, 1.5 on two: not comparable
  assert rows["gemm_b"]["n_apart"] + rows["gemm_b"]["n_beside"] == (
      pytest.approx(1.5))
  assert rows["gemm_b"]["lost"] is None
  assert list(rows)[0] == CUBLAS       # the largest loss first


def test_main_prints_and_writes(ks, tmp_path, capsys, monkeypatch):
  reads = iter([trace.MeasuredTrace("one.json", "/device:GPU:0", (),
                                    tuple(ONE)),
                trace.MeasuredTrace("two.json", "/device:GPU:0", (),
                                    tuple(TWO))])
  monkeypatch.setattr(ks.trace_lib, "read_trace", lambda path: next(reads))
  out = tmp_path / "slow.json"
  ks.main(["one", "two", "--out", str(out)])
  printed = capsys.readouterr().out
  assert "cuBLAS nt 128x128x32" in printed
  assert "summed over the families with as many calls in both 0.05 ms" in (
      printed)
  data = json.loads(out.read_text())
  assert data["families"][0]["lost"] == pytest.approx(50 * US)
  assert data["compute_busy_s"][0] == pytest.approx(260 * US)


def test_an_unreadable_trace_stops_with_its_message(ks, tmp_path):
  with pytest.raises(SystemExit, match="no such file|not found|found"):
    ks.main([str(tmp_path / "missing.json.gz"), str(tmp_path)])
