"""`benchmarks.chip` in the tiny form CI runs: every section reports, and the report puts the sides
together (the torchax side is not installed here; its figures are fed to `report` directly)."""

import json
import os
import subprocess
import sys

from benchmarks import chip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_run_reports_every_section(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.chip", "--size", "tiny", "--no-torchax",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    sections = {f["section"] for f in figures}
    assert sections == {"limits", "forward", "eager", "decode", "ttft"}, sections
    spec = chip.SIZES["tiny"]
    assert len([f for f in figures if f["section"] == "forward"]) == len(spec["forward"])
    assert len([f for f in figures if f["section"] == "decode"]) == len(spec["decode_batches"])
    assert all(f["seconds"] > 0 for f in figures if f["section"] in ("forward", "eager", "ttft"))
    assert "compiled forward" in proc.stdout and "decode batch" in proc.stdout


def test_report_sets_the_sides_side_by_side():
    figures = [
        {"section": "limits", "device": "TPU v5 lite", "platform": "tpu", "matmul_tflops": 160.0, "hbm_gbs": 600.0,
         "peak_tflops": 197.0},
        {"section": "forward", "side": "hf-tpu", "batch": 1, "length": 1024, "seconds": 0.020, "first_call": 30.0},
        {"section": "forward", "side": "torchax", "batch": 1, "length": 1024, "seconds": 0.016, "first_call": 9.0},
    ]
    text = chip.report(figures, chip.SIZES["1b"])
    row = [line for line in text.splitlines() if line.startswith("1x1024")][0].split()
    assert row[1] == "20.00" and row[4] == "16.00" and row[-1] == "0.80x"
    flops = chip._forward_flops(chip.SIZES["1b"]["model"], 1, 1024)
    assert row[2] == f"{100 * flops / 0.020 / 197e12:.0f}%"
