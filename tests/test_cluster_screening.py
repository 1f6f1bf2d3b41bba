"""The cluster validation's judgments (csp_tools/validation): nccl-tests' bandwidth figures, the
pairwise screening that names a bad node rather than a bad pair, and the node checks."""

from __future__ import annotations

import pytest

from csp_tools.validation.bandwidth import Measurement, parse_nccl_tests, peak_busbw
from csp_tools.validation.node_probe import (
    Check,
    ecc_check,
    gpu_count_check,
    inject,
    judged,
    published_figures,
    xid_check,
)
from csp_tools.validation.screening import (
    Limits,
    PairResult,
    disjoint_pairs,
    failures,
    known_good,
    retest_pairs,
    screen,
)

LIMITS = Limits(min_busbw_gbps=10.0, straggler_fraction=0.8)


def test_busbw_is_algbw_times_the_ring_factor() -> None:
    one = Measurement(size_bytes=8 * 2**20, seconds=1e-3, ranks=8)
    assert one.algbw_gbps == pytest.approx(8.388608)
    assert one.busbw_gbps == pytest.approx(8.388608 * 2 * 7 / 8)
    assert Measurement(1000, 1e-6, 2).busbw_gbps == pytest.approx(1.0)  # 2 ranks: factor 1
    gather = Measurement(4000, 1e-6, 4, collective="all_gather")
    assert gather.busbw_gbps == pytest.approx(4.0 * 3 / 4)
    assert peak_busbw([one, Measurement(8, 1e-5, 8)]) == one.busbw_gbps
    with pytest.raises(ValueError):
        peak_busbw([])


def test_an_all_reduce_perf_log_reads_as_sizes_and_busbw() -> None:
    log = "\n".join(
        [
            "# nThread 1 nGpus 1 minBytes 8 maxBytes 8589934592 step: 2(factor)",
            "#       size         count      type   redop    root     time   algbw   busbw #wrong"
            "     time   algbw   busbw #wrong",
            "           8             2     float     sum      -1    31.02    0.00    0.00      0"
            "    30.11    0.00    0.00      0",
            "  1073741824     268435456     float     sum      -1   5702.1  188.31  353.08      0"
            "   5698.4  188.43  353.30      0",
            "# Avg bus bandwidth    : 113.21",
        ]
    )
    assert parse_nccl_tests(log) == {8: 0.0, 1073741824: 353.08}


def test_pairs_are_disjoint_and_an_odd_node_pairs_with_the_first() -> None:
    assert disjoint_pairs(["a", "b", "c", "d"]) == [("a", "b"), ("c", "d")]
    assert disjoint_pairs(["a", "b", "c"]) == [("a", "b"), ("c", "a")]
    with pytest.raises(ValueError, match="2 nodes or more"):
        disjoint_pairs(["a"])
    with pytest.raises(ValueError, match="listed twice"):
        disjoint_pairs(["a", "a"])


def test_a_slow_node_is_named_not_its_pair() -> None:
    nodes = ["n1", "n2", "n3", "n4"]
    first = [PairResult(("n1", "n2"), 2.0), PairResult(("n3", "n4"), 40.0)]
    assert list(failures(first, LIMITS)) == [("n1", "n2")]
    good = known_good(nodes, first, LIMITS)
    assert good == ["n3", "n4"]
    assert retest_pairs([("n1", "n2")], good) == [("n1", "n3"), ("n2", "n4")]
    retests = [PairResult(("n1", "n3"), 41.0), PairResult(("n2", "n4"), 1.9)]
    verdict = screen(nodes, first, retests, LIMITS)
    assert list(verdict.bad) == ["n2"]
    assert "with n1: busbw 2 GB/s < threshold 10" in verdict.bad["n2"]
    assert "retest: busbw 1.9 GB/s < threshold 10" in verdict.bad["n2"]
    assert verdict.unconfirmed == {} and verdict.good == ["n1", "n3", "n4"]


def test_a_straggler_is_judged_against_the_first_rounds_median() -> None:
    nodes = ["n1", "n2", "n3", "n4", "n5", "n6"]
    first = [
        PairResult(("n1", "n2"), 50.0),
        PairResult(("n3", "n4"), 30.0),  # over the threshold, under 0.8 x the median 50
        PairResult(("n5", "n6"), 52.0),
    ]
    assert failures(first, LIMITS) == {("n3", "n4"): "straggler: busbw 30 GB/s < 0.8 x median 50"}
    good = known_good(nodes, first, LIMITS)
    retests = [
        PairResult(pair, 31.0 if "n4" in pair else 50.0)
        for pair in retest_pairs([("n3", "n4")], good)
    ]
    assert screen(nodes, first, retests, LIMITS).bad.keys() == {"n4"}


def test_a_pair_that_did_not_run_fails_and_with_no_good_node_nothing_is_confirmed() -> None:
    nodes = ["n1", "n2", "n3"]
    first = [PairResult(("n1", "n2"), None, "timed out"), PairResult(("n3", "n1"), 1.0)]
    failing = failures(first, LIMITS)
    assert failing[("n1", "n2")] == "did not run: timed out"
    assert set(failing) == {("n1", "n2"), ("n3", "n1")}
    assert known_good(nodes, first, LIMITS) == []
    assert retest_pairs(list(failing), []) == []
    verdict = screen(nodes, first, [], LIMITS)
    assert verdict.bad == {} and sorted(verdict.unconfirmed) == ["n1", "n2", "n3"]
    assert "not retested (no node passed)" in verdict.unconfirmed["n2"]


def test_limits_are_checked() -> None:
    with pytest.raises(ValueError, match="straggler_fraction"):
        Limits(min_busbw_gbps=1, straggler_fraction=1.5)
    with pytest.raises(ValueError, match="min_busbw_gbps"):
        Limits(min_busbw_gbps=-1, straggler_fraction=0.5)


def test_node_checks_judge_what_nvidia_smi_and_the_kernel_log_say() -> None:
    assert gpu_count_check(8, 8).status == "pass"
    assert gpu_count_check(7, 8).detail == "7 GPUs visible, GRES 8"
    assert gpu_count_check(7, 8).status == "fail"
    assert gpu_count_check(8, None).status == "skipped"
    assert ecc_check("0, 0\n1, [N/A]\n").status == "pass"
    failed = ecc_check("0, 0\n1, 3\n2, 1\n")
    assert (
        failed.status == "fail" and failed.detail == "uncorrected ECC errors (GPU 1: 3, GPU 2: 1)"
    )
    log = "[ 12.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=123, GPU has fallen off the bus.\n"
    assert xid_check(log).detail == "1 Xid errors, codes [79]"
    assert xid_check("all quiet\n").status == "pass"
    assert xid_check(None).status == "skipped"


def test_figures_are_judged_against_the_published_ones() -> None:
    assert published_figures("NVIDIA H100 80GB HBM3") == (989.0, 3.35)
    assert published_figures("NVIDIA H100 PCIe") == (756.0, 2.0)
    assert published_figures("NVIDIA A100-SXM4-80GB") == (312.0, 2.039)
    assert published_figures("Tesla T4") is None
    assert judged("m", 600.0, "TFLOP/s", 494.5, "bf16 matmul").status == "pass"
    slow = judged("m", 400.0, "TFLOP/s", 494.5, "bf16 matmul")
    assert slow.status == "fail" and slow.detail == "bf16 matmul 400 TFLOP/s < floor 494.5 TFLOP/s"
    assert judged("m", 1.0, "GB/s", None, "copy").status == "pass"


def test_an_injected_fault_fails_its_check_or_is_reported_unknown() -> None:
    checks = [Check("memory_cpu", "pass", "memory copy 50 GB/s")]
    injected = inject(checks, {"memory_cpu", "no_such"})
    assert [(c.name, c.status) for c in injected] == [("memory_cpu", "fail"), ("no_such", "fail")]
    assert injected[0].detail.startswith("injected fault")
