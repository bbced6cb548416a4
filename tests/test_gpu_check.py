"""benchmarks/gpu_check.sh, the CUDA path's prepared check, run as CI can (`--device cpu`, small sizes, the Triton
kernels under the interpreter) so it still runs when a GPU is lent."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_gpu_check_runs_every_section_on_a_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, DSASERVE_BENCH_DIR=str(tmp_path / "work"))
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), str(tmp_path / "out"),
                           "--device", "cpu", "--budget", "400"], capture_output=True, text=True, env=env, timeout=600)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    failed = {name: r.get("error", "")[-600:] for name, r in results.items() if not r["ok"]}
    assert done.returncode == 0 and not failed, (failed, done.stdout[-2000:])
    assert list(results) == ["env", "parity", "kernels", "syncs", "profile", "latency", "transformers", "longctx"]
    assert results["profile"]["decode_step_top"]  # the step's most expensive operators
    # an FP8 checkpoint kept in FP8, a GLM-5.3-Flash one
    assert {"triton_on", "triton_off", "fp8_triton_on", "flash_triton_on"} <= set(results["parity"])
    assert all(p["tokens_identical"] and p["max_logprob_diff"] < 1e-3 for p in results["parity"].values()
               if isinstance(p, dict))
    for kind in ("fp8", "int8", "int4"):  # each stored form's product agrees with bf16's of the dequantized weight
        assert results["kernels"][f"{kind}_linear_4_rows"]["max_rel_diff"] < 2e-2
    for kind in ("bf16", "fp8"):  # the radix top-k and the scoring kernel's first histogram agree with torch
        assert results["kernels"][f"index_scores_{kind}"]["radix_same_values"]
        assert results["kernels"][f"index_scores_{kind}"]["counts_match"]
    prefill = results["kernels"]["sparse_prefill"]  # tile unions give what the per-query kernel gives
    assert prefill["union_max_diff_8_heads"] < 2e-2 and prefill["union_max_diff_16_heads"] < 2e-2
    latency = results["latency"]["default"]
    assert latency["graphs"] == "off" and latency["latency_batch_1"]["tpot_ms_p50"] > 0  # (a CPU captures none)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| parity, Triton on: tokens identical / max Δlogprob | True /" in summary
    assert "sections failed: none" in summary


def test_a_section_that_runs_out_of_time_keeps_what_it_measured(tmp_path):
    """A section's results reach OUT/NAME.partial.json as each is added (gpu_check.Progress), and the parent reads
    them back for a section it had to stop: one slow measurement does not lose the section's others."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    progress = gpu_check.Progress()
    progress.path = str(tmp_path / "kernels.partial.json")
    progress["sparse_decode"] = {"triton_ms": 0.5}
    progress.update(index_scores_bf16={"triton_ms": 0.25})
    assert gpu_check.partial(str(tmp_path), "kernels") == {
        "partial": {"sparse_decode": {"triton_ms": 0.5}, "index_scores_bf16": {"triton_ms": 0.25}}}
    assert gpu_check.partial(str(tmp_path), "latency") == {}
