"""`benchmarks.chip` in the tiny form CI runs: every group reports, each figure is printed and saved the moment
it is measured, a group past its time limit is stopped without losing the others, and the report and the plot
put the sides together (the torchax side is not installed here; its figures are fed to `report` directly)."""

import json
import math
import os
import subprocess
import sys

from benchmarks import chip, training

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chip(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "benchmarks.chip", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_tiny_run_reports_every_group(tmp_path):
    """One row a group (batch 2, prompt 16) keeps the run short; the grid's loops are the same."""
    out, png = tmp_path / "figures.json", tmp_path / "chip.png"
    proc = _chip("--size", "tiny", "--batches", "2", "--lengths", "16", "--json", str(out), "--plot", str(png),
                 "--profile", str(tmp_path / "profile"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    by_section = {}
    for figure in figures:
        by_section.setdefault(figure["section"], []).append(figure)
    assert {"run", "limits", "products", "forward", "eager", "ttft"} <= set(by_section), set(by_section)
    assert [(f["batch"], f["length"]) for f in by_section["products"]] == [(2, 16)]
    assert by_section["products"][0]["seconds"] > 0 and by_section["products"][0]["call_seconds"] > 0
    assert [(f["batch"], f["length"]) for f in by_section["forward"] if f["side"] == "hf-tpu"] == [(2, 16)]
    # a decode step of the tiny model (tens of microseconds on the CPU) may be below the timing noise: then its
    # row is a skip saying so, never a figure that is not positive
    skipped = {f["row"] for f in by_section.get("skipped", []) if f["reason"] == chip._BELOW_NOISE}
    decode = [(f["batch"], f["length"]) for f in by_section.get("decode", [])]
    assert decode == [(2, 16)] or (not decode and "2x16" in skipped)
    moe = {f["implementation"] for f in by_section.get("moe", [])}
    assert moe | {row.split()[0] for row in skipped if row != "2x16"} == {"grouped_mm", "eager"}
    assert all(f["step_seconds"] > 0 for f in by_section.get("decode", []) + by_section.get("moe", []))
    assert all(f["seconds"] > 0 for f in by_section["forward"] + by_section["eager"] + by_section["ttft"])
    assert all(f["reason"] for f in by_section.get("skipped", []))  # torchax, where it is not installed
    # the CPU records no device plane: the profile row is there, with no ops
    assert sorted((f["side"], f["ops"], f["programs"]) for f in by_section["profile"]) == [
        ("forward", [], {}), ("generate", [], {}), ("hf-tpu", [], {}), ("hf-tpu decode", [], {})]
    assert all(f["wall_us"] > 0 for f in by_section["profile"])
    assert list((tmp_path / "profile" / "forward" / "2x16").rglob("*.xplane.pb"))
    printed = proc.stdout.splitlines()
    assert any(line.startswith("[forward] hf-tpu forward 2x16:") for line in printed)
    assert any(line.startswith("[moe] eager decode batch 2") or line.startswith("[moe] skipped eager 2x16")
               for line in printed)
    assert "compiled forward" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_group_past_its_time_limit_is_stopped_and_the_figures_before_it_kept(tmp_path):
    out = tmp_path / "figures.json"
    proc = _chip("--size", "tiny", "--only", "eager", "--timeout", "1", "--json", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert [f["section"] for f in figures] == ["run", "skipped"]
    assert figures[1]["group"] == "eager" and "time limit of 1 s" in figures[1]["reason"]
    assert "[eager] skipped eager: stopped after its time limit of 1 s" in proc.stdout


def test_unknown_group_is_an_argument_error():
    proc = _chip("--only", "forward,prefill", timeout=60)
    assert proc.returncode == 2 and "unknown groups prefill" in proc.stderr


def test_memory_check_on_a_v5e():
    """1.1B parameters in bfloat16 are 2.2 GB; at batch 64 the 4096-token KV cache (8.9 GB) would fit, the
    prefill's materialised attention scores would not. The MoE model's weights stay under 8 GB."""
    spec, v5e = chip.SIZES["1b"], 16.9e9
    assert 2.1e9 < chip.weight_bytes(spec["model"]) < 2.3e9
    assert chip.weight_bytes(spec["moe"]) < 8e9
    assert chip.does_not_fit(spec["model"], 1, 4096, v5e) is None
    assert chip.does_not_fit(spec["model"], 8, 1024, v5e) is None
    assert chip.does_not_fit(spec["model"], 64, 128, v5e, new_tokens=65) is None
    reason = chip.does_not_fit(spec["model"], 64, 4096, v5e, new_tokens=65)
    assert "attention scores" in reason and "of the device's 16.9 GB" in reason
    assert chip.memory_estimate(spec["model"], 64, 4096, 65)["KV cache"] == 64 * 4224 * 16 * 2 * 8 * 64 * 2
    # the HBM limit of decoding at batch 1: every matmul weight read once a step (2.54 ms at 819 GB/s)
    step = 1 / chip.decode_limit_tokens_per_second(spec["model"], 1, 0, 819e9)
    assert 2.5e-3 < step < 2.6e-3


def _figures():
    forward = dict(section="forward", group="forward", side="hf-tpu", batch=1)
    decode = dict(section="decode", group="decode", side="hf-tpu", length=128, context=160)
    moe = dict(section="moe", group="moe", side="hf-tpu", batch=64, length=16, context=20)
    return [
        dict(section="run", size="1b", batches=[1, 8, 64], lengths=[128, 1024, 4096], started="-", command="-"),
        dict(section="limits", group="limits", device="TPU v5 lite", platform="tpu", matmul_tflops=160.0,
             hbm_gbs=600.0, peak_tflops=197.0, peak_hbm_gbs=819.0, memory_gb=16.9),
        dict(forward, length=1024, seconds=0.020, first_call=30.0),
        dict(forward, group="torchax", side="torchax", length=1024, seconds=0.016, first_call=9.0),
        dict(forward, length=128, seconds=0.005, first_call=20.0),
        dict(section="products", group="limits", batch=1, length=1024, seconds=0.013, tflops=160.0,
             call_seconds=0.0003, inputs=114),
        dict(decode, batch=1, step_seconds=0.003, first_call=35.0),
        dict(decode, batch=64, step_seconds=0.006, first_call=40.0),
        dict(moe, implementation="grouped_mm", step_seconds=0.012, first_call=50.0),
        dict(moe, implementation="eager", step_seconds=1.2, first_call=90.0),
        dict(section="skipped", group="decode", row="64x4096", reason="needs ~303 GB"),
    ]


def test_report_sets_the_sides_side_by_side():
    spec = chip.SIZES["1b"]
    text = chip.report(_figures(), spec)
    row = [line for line in text.splitlines() if line.startswith("1x1024")][0].split()
    assert row[1] == "20.00" and row[4] == "16.00" and row[-2] == "0.80x" and row[-1] == "13.00"
    unmeasured = [line for line in text.splitlines() if line.startswith("1x128 ")][0].split()
    assert unmeasured[-2:] == ["-", "-"]
    flops = chip.forward_flops(spec["model"], 1, 1024)
    assert row[2] == f"{100 * flops / 0.020 / 197e12:.0f}%"
    decode = [line for line in text.splitlines() if line.startswith("1x128 ") and "3.00" in line][0].split()
    limit = chip.decode_limit_tokens_per_second(spec["model"], 1, 160, 819e9)
    assert decode[2] == "333" and decode[3] == f"{limit:.0f}"
    assert "grouped_mm is 100.0x the per-expert loop (eager)" in text
    assert "[decode] 64x4096: needs ~303 GB" in text


def test_a_per_expert_loop_stopped_by_max_time_bounds_the_ratio_from_below():
    """On the chip the per-expert loop compiles at every step and is stopped by `max_time`: its time per token
    holds those compiles, so the ratio is printed as a bound."""
    figures = [f if f.get("implementation") != "eager" else dict(f, step_seconds=2.4, first_call=150.0, capped_tokens=62)
               for f in _figures()]
    text = chip.report(figures, chip.SIZES["1b"])
    assert "grouped_mm is at least 200.0x the per-expert loop (eager, stopped by max_time, every step compiling)" in text
    line = chip.describe(next(f for f in figures if f.get("implementation") == "eager"), chip.SIZES["1b"], None)
    assert line.endswith("stopped by max_time after 150 s with 62 new tokens (every step compiles)"), line


def test_saved_figures_are_reported_and_plotted(tmp_path):
    """Each device call's run of some groups is saved to a file of its own; the report takes them together."""
    first, second, png = tmp_path / "forward.json", tmp_path / "decode.json", tmp_path / "chip.png"
    figures = _figures()
    first.write_text(json.dumps(figures[:5]))
    second.write_text(json.dumps(figures[:1] + figures[5:]))
    proc = _chip("--figures", str(first), str(second), "--plot", str(png), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "0.80x" in proc.stdout and "grouped_mm is 100.0x" in proc.stdout and f"plot: {png}" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_memory_estimate_leaves_out_the_score_matrix_where_flash_attention_runs():
    spec, v5e = chip.SIZES["1b"], 16.9e9
    assert chip.does_not_fit(spec["model"], 8, 4096, v5e) is not None  # torchax's XLA attention: 34 GB of scores
    assert chip.does_not_fit(spec["model"], 8, 4096, v5e, score_matrix=False) is None
    assert "attention scores" not in chip.memory_estimate(spec["model"], 8, 4096, score_matrix=False)


def test_device_op_times_sum_each_op_of_the_device_plane_per_call(tmp_path):
    """`--profile`'s table, from a trace holding what a TPU records: each XLA op on the device plane's
    "XLA Ops" line, and lines (whole programs) and planes (the host's) that are not ops. The v5e names an op by
    its whole HLO text (2026-12-06), with no `long_name` stat: the text the kinds are read from."""
    from jax.profiler import ProfileData

    from benchmarks.chip import _device_op_times, _device_program_times, _kinds

    matmul = "%fusion.1 = bf16[128,8192]{1,0} fusion(bf16[8192,2048]{1,0} %custom-call.4), kind=kOutput, calls=%f"

    def event(metadata, start_us, length_us):
        return f"events {{ metadata_id: {metadata} offset_ps: {start_us * 10**6} duration_ps: {length_us * 10**6} }}"

    ops = " ".join([event(1, 0, 30), event(2, 40, 10), event(1, 60, 30), event(2, 100, 12)])
    trace = f"""
    planes {{ id: 1 name: "/device:TPU:0"
      lines {{ id: 1 name: "XLA Ops" {ops} }}
      lines {{ id: 2 name: "XLA Modules" {event(3, 0, 120)} }}
      event_metadata {{ key: 1 value {{ id: 1 name: "{matmul}" }} }}
      event_metadata {{ key: 2 value {{ id: 2 name: "copy.2" }} }}
      event_metadata {{ key: 3 value {{ id: 3 name: "jit_forward" }} }} }}
    planes {{ id: 2 name: "/host:CPU" lines {{ id: 1 name: "python" {event(3, 0, 500)} }}
      event_metadata {{ key: 3 value {{ id: 3 name: "forward" }} }} }}
    """
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "host.xplane.pb").write_bytes(ProfileData.text_proto_to_serialized_xspace(trace))
    ops = _device_op_times(str(tmp_path), calls=2)
    assert ops == [(matmul, 30.0, 1.0, matmul), ("copy.2", 11.0, 1.0, "copy.2")]
    assert _kinds(ops) == {"fusion kOutput": (30.0, 1.0), "?": (11.0, 1.0)}
    assert _device_program_times(str(tmp_path), calls=2) == {"jit_forward": (60.0, 0.5)}


def test_profile_kinds_group_every_op_by_instruction_and_fusion_kind():
    """`--profile`'s summary: device time and op count per kind, from each op's HLO text as a TPU names it."""
    from benchmarks.chip import _kinds

    matmul = ("%fusion.4 = bf16[128,8192]{1,0:T(8,128)(2,1)S(1)} fusion(bf16[8192,2048]{1,0} %custom-call.4), "
              "kind=kOutput, calls=%fused_computation.38")
    two_outputs = "%fusion.47 = (f32[128]{0:T(128)S(1)}, bf16[128,2048]{1,0}) fusion(bf16[128,2048]{1,0} %g), kind=kOutput"
    elementwise = "%fusion.9 = bf16[128,2048]{1,0} fusion(bf16[128,2048]{1,0} %a), kind=kLoop, calls=%f"
    copy = "%copy-done.1 = bf16[8192,2048]{1,0:T(8,128)(2,1)S(1)} copy-done((bf16[8192,2048]{1,0}) %copy-start.1)"
    ops = [("fusion.4", 25.0, 1.0, matmul), ("fusion.47", 93.0, 1.0, two_outputs), ("copy-done.1", 41.0, 2.0, copy),
           ("fusion.9", 3.0, 1.0, elementwise), ("unknown", 1.0, 1.0, "")]
    assert _kinds(ops) == {"fusion kOutput": (118.0, 2.0), "copy-done": (41.0, 2.0), "fusion kLoop": (3.0, 1.0),
                           "?": (1.0, 1.0)}


def test_the_cache_write_benchmark_times_both_writes_and_they_agree(tmp_path):
    """`benchmarks.cache_write` in its small form: every case timed both ways; and the dynamic-update-slice
    writes what the scatter (hf-tpu's `index_copy_` lowering) writes, at an offset inside the cache."""
    import jax
    import jax.numpy as jnp

    from benchmarks import cache_write

    cache_write.main(["--json", str(tmp_path / "rows.json")])
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert {name.rsplit(" ", 1)[1] for name in rows} == {"scatter", "dynamic_update_slice"} and len(rows) == 6
    assert all(row["compile"] > 0 and row["ms"] > 0 for row in rows.values())
    cache = jax.random.normal(jax.random.key(0), (2, 3, 16, 4)).astype(jnp.bfloat16)
    new = jax.random.normal(jax.random.key(1), (2, 3, 5, 4)).astype(jnp.bfloat16)
    start = jnp.int32(7)
    assert jnp.array_equal(cache_write._scatter(cache, new, start), cache_write._update_slice(cache, new, start))


def test_the_float32_compile_benchmark_compiles_each_precision_in_its_own_process(tmp_path):
    """`benchmarks.float32_compile` in its small form: one row per (depth, precision), each compiled in a process
    of its own; and its encoder computes BERT's layer, checked against a NumPy forward of one layer."""
    import jax
    import numpy as np

    from benchmarks import float32_compile

    float32_compile.main(["--layers", "1", "--precisions", "highest,default", "--json", str(tmp_path / "rows.json")])
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert list(rows) == ["1 layer, highest", "1 layer, default"]
    assert all(row["compile"] > 0 and row["ms"] > 0 for row in rows.values())
    assert rows["1 layer, highest"]["max_diff"] == 0

    rng = np.random.default_rng(0)
    hidden, heads, batch, length = 8, 2, 2, 3
    x = rng.standard_normal((batch, length, hidden))
    weights = [rng.standard_normal(s) for s in [(hidden, hidden)] * 4 + [(hidden, 16), (16, hidden)]]
    query, key, value, output, up, down = weights

    def norm(t):
        return (t - t.mean(-1, keepdims=True)) / np.sqrt(t.var(-1, keepdims=True) + 1e-12)

    def split(t):
        return t.reshape(batch, length, heads, -1).transpose(0, 2, 1, 3)

    scores = split(x @ query) @ split(x @ key).transpose(0, 1, 3, 2) / np.sqrt(hidden // heads)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    attended = (probs / probs.sum(-1, keepdims=True)) @ split(x @ value)
    h = norm(x + attended.transpose(0, 2, 1, 3).reshape(batch, length, hidden) @ output)
    inner = h @ up
    gelu = 0.5 * inner * (1 + np.vectorize(math.erf)(inner / np.sqrt(2)))
    expected = norm(h + gelu @ down)
    encoder = float32_compile._encoder(1, jax.lax.Precision.HIGHEST, heads)
    actual = encoder(x.astype(np.float32), [tuple(w.astype(np.float32) for w in weights)])
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=1e-4, atol=1e-4)


def test_a_capped_call_stops_at_max_time_and_counts_what_it_made_else_the_step_is_timed_warm():
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM._from_config(Qwen3MoeConfig(**chip.SIZES["tiny"]["moe"])).eval().to("tpu")
    model.set_experts_implementation("eager")
    ids = torch.randint(0, 128, (2, 16)).to("tpu")
    step, seconds, made = chip._capped_step_seconds(model, ids, 8, 1e-6)  # stopped after the first token
    assert made == 1 and step == seconds > 0
    step, seconds, made = chip._capped_step_seconds(model, ids, 4, 600.0)  # every call ends: timed warm
    assert made is None and seconds > 0 and (step is None or 0 < step < seconds)


def test_the_first_token_timeline_marks_each_step_of_a_warm_generate_in_order():
    """`benchmarks.first_token_timeline` on the tiny model: every mark a compiled prefill reaches, in the order a
    warm call reaches them (its prefill launched ahead of Transformers' setup), and Transformers' methods back on
    the model's class afterwards."""
    from transformers import LlamaForCausalLM

    from benchmarks import first_token_timeline

    medians = first_token_timeline.timeline("tiny", 16, calls=3)
    assert list(medians) == ["config resolved", "traced call made", "launch started", "launched", "prefill entered",
                             "logits computed", "logits on the host", "returned", "synchronized"], medians
    assert sorted(medians) == sorted(first_token_timeline.MARKS)
    assert list(medians.values()) == sorted(medians.values())
    assert "_prefill" not in vars(LlamaForCausalLM) and "_prepare_generation_config" not in vars(LlamaForCausalLM)


def test_the_train_group_times_a_traced_step_and_reports_its_memory(tmp_path):
    """`--only train,train_compile` at the tiny size, their first row (bfloat16, checkpointed): a row process of its
    own times the whole step traced by `hf_tpu.jit`, the first step's time split by phase, the program's memory by
    XLA's analysis beside the arithmetic, and losses that fall; another the step through `torch.compile`, with the
    same losses."""
    out = tmp_path / "figures.json"
    proc = _chip("--size", "tiny", "--only", "train,train_compile", "--train-rows", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    row, compiled = [f for f in json.loads(out.read_text()) if f["section"] == "train"]
    assert (compiled["group"], compiled["mode"], compiled["step_seconds"] > 0) == ("train_compile", "compile", True)
    assert all(abs(a - b) < 1e-2 for a, b in zip(row["losses"], compiled["losses"])), (row["losses"], compiled["losses"])
    assert (row["side"], row["mode"], row["recipe"], row["checkpointing"]) == ("hf-tpu", "jit", "bf16", True)
    assert row["step_seconds"] > 0 and row["first_step"] > row["step_seconds"] and row["fallbacks"] == 0
    assert row["first_split"]["XLA"] > 0 and row["first_split"]["Python trace"] > 0
    assert row["memory_analysis"]["temp"] > 0 and row["memory_analysis"]["alias"] > 0  # parameters donated
    assert row["losses"][-1] < row["losses"][0]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("[train] hf-tpu jit tiny bf16 2x32"))
    assert "by XLA's analysis" in line and "arithmetic" in line and "first step" in line
    assert "training step (forward, backward, AdamW)" in proc.stdout


def test_the_trainer_group_times_the_trainers_traced_steps(tmp_path):
    """`--only train_trainer` at the tiny size, its first row: Transformers' Trainer trains the row's model in a
    process of its own, timed from one logged loss to the next, its first step split by compile phase."""
    out = tmp_path / "figures.json"
    proc = _chip("--size", "tiny", "--only", "train_trainer", "--train-rows", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [f for f in json.loads(out.read_text()) if f["section"] == "train"]
    assert (row["side"], row["mode"], row["recipe"], row["checkpointing"]) == ("hf-tpu", "Trainer", "bf16", True)
    assert row["step_seconds"] > 0 and row["first_step"] > row["step_seconds"] and row["fallbacks"] == 0
    assert row["first_split"]["XLA"] > 0 and row["first_split"]["Python trace"] > 0  # its steps were traced
    assert len(row["losses"]) == 4
    # its last step, at 31 tokens, pads to the same bucket as 32: measured apart, out of the median
    assert row["bucket_step"]["length"] == 31 and row["bucket_step"]["seconds"] > 0
    assert row["bucket_step"]["programs_traced"] >= 0 and row["bucket_step"]["xla_compiles"] >= 0
    line = next(line for line in proc.stdout.splitlines() if line.startswith("[train_trainer] hf-tpu Trainer tiny bf16 2x32"))
    assert "a last step of 31 tokens (the same bucket)" in line and "programs traced" in line


def test_the_trainer_phases_count_what_a_step_launches_and_reads_beside_the_traced_step():
    """`benchmarks.trainer_phases` (a chip command) at the tiny size: a `bf16=True` Trainer step of 2 micro-batches
    launches the zero gradients', the micro steps', the clipping's and the optimizer's programs and reads the host
    only for what it logs; `--jit` runs the same tokens as one traced step, one program and one read a step."""
    def per_step(*args):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.trainer_phases", "--model", "tiny", "--length", "16",
                               "--steps", "2", "--mixed", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return next(line for line in proc.stdout.splitlines() if line.startswith("  per optimizer step: "))

    trainer = per_step("--accumulation", "2")
    assert "programs_launched 5," in trainer and "host_syncs 3," in trainer and "xla_compiles 0" in trainer, trainer
    traced = per_step("--jit")
    assert "programs_launched 1," in traced and "ops_dispatched 0," in traced and "host_syncs 1," in traced, traced


def test_the_libraries_group_trains_through_the_trainer_peft_and_accelerate_launch(tmp_path):
    """`--only train_libraries` at the tiny size: the Trainer with `bf16=True`, 4 micro-batches a step and
    checkpointing, traced and with `torch_compile=True` (the same losses); PEFT's LoRA through the Trainer, its
    adapters alone trained, its frozen weights still bfloat16 on tpu, the adapters saved and reloaded with the
    trained logits; a plain Accelerate loop in a process Accelerate's launcher started. Each in a process of its own."""
    out = tmp_path / "figures.json"
    proc = _chip("--size", "tiny", "--only", "train_libraries", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert not [f for f in figures if f["section"] == "skipped"], figures
    rows = {(f["mode"], f["recipe"]): f for f in figures if f["section"] == "train"}
    assert sorted(rows) == [("Trainer", "lora"), ("Trainer", "mixed"), ("Trainer compile", "mixed"),
                            ("accelerate launch", "bf16")]
    assert all(f["group"] == "train_libraries" and f["step_seconds"] > 0 and f["fallbacks"] == 0 for f in rows.values())
    traced, compiled = rows["Trainer", "mixed"], rows["Trainer compile", "mixed"]
    assert (traced["accumulation"], traced["batch"], traced["checkpointing"]) == (4, 8, True)
    assert all(abs(a - b) < 1e-2 for a, b in zip(traced["losses"], compiled["losses"]))
    trainer_rows = [rows[key] for key in rows if key[0] != "accelerate launch"]
    # a last batch inside the bucket: padded to it by the Trainer, it runs the programs compiled already
    assert all(r["bucket_step"]["length"] == 31 and r["bucket_step"]["programs_traced"] == 0 for r in trainer_rows)
    adapters = rows["Trainer", "lora"]["adapters"]
    assert adapters["trainable"] == training.adapter_parameters(chip.SIZES["tiny"]["train"]["models"]["tiny"])
    assert adapters["reload_difference"] <= adapters["reload_tolerance"]
    assert rows["accelerate launch", "bf16"]["launch"] == {"distributed_type": "DistributedType.NO",
                                                          "accelerator_device": "tpu:0", "mixed_precision": "no"}
    printed = [line for line in proc.stdout.splitlines() if line.startswith("[train_libraries] hf-tpu")]
    assert len(printed) == 4 and all("tokens/s" in line and "a last step" in line for line in printed[:3])
    assert "only the adapters train" in printed[2] and "MFU counts LoRA's FLOPs" in printed[2]
    assert "started by `accelerate launch" in printed[3]


def test_a_training_row_past_its_time_limit_is_stopped_with_the_processes_it_started():
    """A library row's process is stopped with its children (Accelerate's launcher runs the script as one)."""
    import time

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; child = subprocess.Popen("
                               "[sys.executable, '-c', 'import time; time.sleep(60)']); print(child.pid, flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    training._stop_process_tree(parent.pid)
    assert parent.wait(timeout=10) == -9
    def running(pid: int) -> bool:  # a killed orphan is reaped by init, or waits for it as a zombie
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(child), f"the row's child {child} is still running"


def test_the_train_report_puts_each_way_beside_torchax():
    spec = chip.SIZES["1b"]
    common = dict(section="train", model="1.1b", recipe="bf16", batch=8, length=1024, checkpointing=True,
                  device="TPU v5 lite", first_split={"XLA": 30.0}, second_step=1.0, losses=[10.4, 10.3, 10.2],
                  peak_bytes=12 * 2**30, memory_analysis=None)
    figures = [dict(common, group="train", side="hf-tpu", mode="jit", step_seconds=0.5, first_step=50.0),
               dict(common, group="train_eager", side="hf-tpu", mode="DEFER_AND_FUSE", step_seconds=0.8,
                    first_step=90.0),
               dict(common, group="train_torchax", side="torchax", mode="jit", step_seconds=0.6, first_step=40.0)]
    text = chip.report(figures, spec)
    jit = next(line for line in text.splitlines() if "hf-tpu jit" in line).split()
    flops = training.train_flops(spec["train"]["models"]["1.1b"], 8, 1024)
    assert jit[-1] == "1.20x" and jit[-5] == f"{100 * flops / 0.5 / 197e12:.0f}%"
    assert next(line for line in text.splitlines() if "DEFER_AND_FUSE" in line).split()[-1] == "0.75x"
    line = chip.describe(figures[0], spec)
    parts = training.train_memory(spec["train"]["models"]["1.1b"], 8, 1024, "bf16", True)
    assert f"({12 * 2**30 / sum(parts.values()):.2f}x the arithmetic)" in line and "MFU" in line
    # LoRA's MFU counts its own FLOPs: no weight gradients of the frozen weights, the adapters' in full
    lora = dict(figures[0], group="train_libraries", mode="Trainer", recipe="lora", accumulation=1)
    lora_flops = training.train_flops(spec["train"]["models"]["1.1b"], 8, 1024, "lora")
    assert 0.6 * flops < lora_flops < 0.75 * flops
    assert f"MFU {100 * lora_flops / 0.5 / 197e12:.0f}%" in chip.describe(lora, spec)


def test_the_train_memory_arithmetic_of_the_rows():
    """The 1.1B's bfloat16 parameters, gradients and moments (8 bytes a parameter) fit a v5e with its checkpointed
    activations; the mixed recipe's float32 ones (16 bytes, 17.6 GB) do not, before any activation. LoRA's step
    holds the frozen bfloat16 weights, the adapters' float32 state and one micro-batch's activations."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    models = chip.SIZES["1b"]["train"]["models"]
    for name, config in models.items():  # the arithmetic counts what Transformers and PEFT build (on meta: no memory)
        with torch.device("meta"):
            built = LlamaForCausalLM(LlamaConfig(**config))
            assert training.parameters(config) == sum(p.numel() for p in built.parameters()), name
            built = get_peft_model(built, LoraConfig(r=training.LORA_RANK, target_modules=list(training.LORA_TARGETS),
                                                     task_type="CAUSAL_LM"))
        assert training.adapter_parameters(config) == sum(p.numel() for p in built.parameters() if p.requires_grad)
    lora = training.train_memory(models["1.1b"], 8, 1024, "lora", True)
    assert lora["frozen parameters"] == 2 * training.parameters(models["1.1b"])
    assert lora["adapter AdamW moments"] == 2 * lora["adapters"] == 8 * training.adapter_parameters(models["1.1b"])
    full = training.train_memory(models["0.44b"], 8, 1024, "mixed", True)
    accumulated = training.train_memory(models["0.44b"], 8, 1024, "mixed", True, accumulation=4)
    assert accumulated["activations"] == full["activations"] / 4 and accumulated["logits"] == full["logits"] / 4
    assert 1.09e9 < training.parameters(models["1.1b"]) < 1.11e9
    assert 0.46e9 < training.parameters(models["0.44b"]) < 0.48e9
    v5e = 15.75 * 2**30
    assert sum(training.train_memory(models["1.1b"], 8, 1024, "bf16", True).values()) < v5e
    assert sum(training.train_memory(models["1.1b"], 8, 1024, "bf16", False).values()) > v5e
    mixed = training.train_memory(models["1.1b"], 8, 1024, "mixed", True)
    assert mixed["parameters"] + mixed["gradients"] + mixed["AdamW moments"] > v5e


def test_tiny_quantization_run_reports_each_form_beside_bfloat16(tmp_path):
    """`--only quant,quant_prefill,quant_big` at the tiny size: the Llama model loaded from its bfloat16 checkpoint
    in each torchao config, decoding (or skipped below the timing noise), the prefill in bfloat16 and with int8
    activations, what XLA made of each quantized program, the raw-JAX forms; the two big-model stand-ins written,
    loaded in int8 and decoding."""
    out = tmp_path / "figures.json"
    proc = _chip("--size", "tiny", "--only", "quant,quant_prefill,quant_big", "--batches", "2", "--lengths", "16",
                 "--json", str(out), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    by_section = {}
    for figure in json.loads(out.read_text()):
        by_section.setdefault(figure["section"], []).append(figure)
    variants = ["bf16", "int8 weight-only", "int4 group 32", "int8 activations+weights"]
    assert [f["variant"] for f in by_section["quant_load"]] == variants[:3] + ["bf16", variants[3]]
    loads = {f["variant"]: f["step_bytes"] for f in by_section["quant_load"]}
    assert loads["int4 group 32"] < loads["int8 weight-only"] < loads["bf16"]
    skipped = {f["row"] for f in by_section.get("skipped", [])}
    for variant in variants[:3]:
        decoded = [f for f in by_section.get("quant_decode", []) if f["variant"] == variant]
        assert [f["batch"] for f in decoded] == [2] or f"{variant} decode 2x16" in skipped
    assert [f["variant"] for f in by_section["quant_prefill"]] == ["bf16", "int8 activations+weights"]
    hlo = {(f["variant"], f["program"]): f for f in by_section["quant_hlo"]}
    assert hlo[("int8 activations+weights", "traced_forward")]["int8_products"] == 7  # a layer's 7 linear layers
    assert all(f["products"] > 0 for f in hlo.values())
    assert [f["form"] for f in by_section["quant_forms"]] == ["bf16", "int8", "int4 two products", "int4 lowering",
                                                               "int4 interleaved", "int4 JAX int4 array"]
    assert [f["model"] for f in by_section["quant_big_load"]] == ["llama-tiny", "qwen3-tiny"]
    assert all(f["held"] > 0 and f["peak"] >= f["held"] for f in by_section["quant_big_load"])
    for model in ("llama-tiny", "qwen3-tiny"):
        assert (any(f["model"] == model for f in by_section.get("quant_big_decode", []))
                or f"{model} decode" in skipped)
    assert "quantized decode" in proc.stdout or {f"{v} decode 2x16" for v in variants[:3]} <= skipped
    assert "big models in int8 on one chip" in proc.stdout and "prefill" in proc.stdout


def test_the_hlo_summary_tells_fused_conversions_from_written_weights():
    """What `quant_hlo` rows count, on HLO as a TPU's XLA prints it: a product converting its int8 weight inside its
    own fusion, a product of one row as the v5e's XLA writes it (a multiply by the broadcast row and a reduce, the
    int8 weight converted inside: read as int8, not a dequantized weight written), a product of int8 operands,
    and (as XLA:CPU does) an int8 weight converted to floats on its own."""
    from benchmarks.quant import hlo_summary

    text = """HloModule jit_loop_body
%fused_computation.7 (param_0: bf16[1,2048], param_1: s8[8192,2048]) -> f32[1,8192] {
  %param_1 = s8[8192,2048]{1,0:T(8,128)(4,1)} parameter(1)
  %convert.3 = bf16[8192,2048]{1,0:T(8,128)(2,1)} convert(%param_1)
  %param_0 = bf16[1,2048]{1,0} parameter(0)
  ROOT %convolution.2 = f32[1,8192]{1,0} convolution(%param_0, %convert.3), dim_labels=bf_oi->bf
}
%fused_computation.9 (param_0.1: s8[64,2048], param_1.1: s8[2048,2048]) -> s32[64,2048] {
  %param_0.1 = s8[64,2048]{1,0} parameter(0)
  %param_1.1 = s8[2048,2048]{1,0} parameter(1)
  ROOT %convolution.5 = s32[64,2048]{1,0} convolution(s8[64,2048]{1,0} %param_0.1, s8[2048,2048]{1,0} %param_1.1)
}
%fused_computation.6 (param_0.7: s8[8192,2048], param_1.7: f32[8192]) -> bf16[2048] {
  %param_1.7 = f32[8192]{0:T(1024)S(1)} parameter(1)
  %broadcast.12 = f32[8192,2048]{1,0:T(8,128)} broadcast(%param_1.7), dimensions={0}
  %param_0.7 = s8[8192,2048]{1,0:T(8,128)(4,1)S(1)} parameter(0)
  %convert.14 = f32[8192,2048]{1,0:T(8,128)} convert(%param_0.7)
  %multiply.5 = f32[8192,2048]{1,0:T(8,128)} multiply(%broadcast.12, %convert.14)
  %constant.1 = f32[]{:T(128)} constant(0)
  ROOT %reduce.5 = bf16[2048]{0:T(1024)(128)(2,1)S(1)} reduce(%multiply.5, %constant.1), dimensions={0}, to_apply=%add
}
%fused_computation.2 (param_0.2: bf16[2048]) -> f32[] {
  %param_0.2 = bf16[2048]{0} parameter(0)
  %convert.2 = f32[2048]{0} convert(%param_0.2)
  %multiply.2 = f32[2048]{0} multiply(%convert.2, %convert.2)
  %constant.2 = f32[] constant(0)
  ROOT %reduce.2 = f32[] reduce(%multiply.2, %constant.2), dimensions={0}, to_apply=%add
}
%fused_computation.3 (param_0.8: s8[256,512]) -> f32[512,256] {
  %param_0.8 = s8[256,512]{1,0} parameter(0)
  %transpose.4 = s8[512,256]{0,1} transpose(%param_0.8), dimensions={1,0}
  ROOT %convert.9 = f32[512,256]{1,0} convert(%transpose.4)
}
ENTRY %main (p0: bf16[1,2048]) -> f32[1,8192] {
  %p0 = bf16[1,2048]{1,0} parameter(0)
  ROOT %fusion.1 = f32[1,8192]{1,0} fusion(%p0), kind=kOutput, calls=%fused_computation.7
}
"""
    assert hlo_summary(text, least_elements=1024) == dict(products=3, int8_products=1, fused_conversions=2,
                                                          written_dequantized=1, written_bytes=512 * 256 * 4)


def test_a_loop_iterations_hbm_bytes_count_what_crosses_between_hbm_and_vmem():
    """`quant_hlo --decode`'s bytes an iteration moves, on a while loop's body as the v5e's XLA prints it: an int8
    weight read from HBM by its product (its result in VMEM, `S(1)`: not counted), a weight prefetched into VMEM
    by an asynchronous slice (its slice, once; the product reading it in VMEM: nothing more), an embedding row
    sliced inside a fusion (the row and its index, not the table), a KV cache copied into VMEM (once) and its token
    updated in place there (the token, read and written), and 64-bit integers' halves (nothing)."""
    from benchmarks.quant_hlo import loop_body_traffic

    text = """HloModule jit_loop_body
%fused_computation.1 (param_0: bf16[32000,2048], param_1: s32[]) -> f32[1,2048] {
  %param_0 = bf16[32000,2048]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1 = s32[]{:T(128)} parameter(1)
  %constant.1 = s32[]{:T(128)} constant(0)
  %dynamic-slice.1 = bf16[1,2048]{1,0:T(2,128)(2,1)} dynamic-slice(%param_0, %param_1, %constant.1)
  ROOT %convert.1 = f32[1,2048]{1,0:T(1,128)S(1)} convert(%dynamic-slice.1)
}
%fused_computation.2 (param_0.2: s8[5632,2048], param_1.2: f32[1,2048]) -> bf16[5632] {
  %param_0.2 = s8[5632,2048]{1,0:T(32,128)(4,1)} parameter(0)
  %param_1.2 = f32[1,2048]{1,0:T(1,128)S(1)} parameter(1)
  ROOT %reduce.2 = bf16[5632]{0:T(1024)(128)(2,1)S(1)} reduce(%param_0.2, %param_1.2), dimensions={1}
}
%body (state: (bf16[32000,2048], s8[5632,2048], s8[2048,5632], bf16[1,4,256,64], s64[])) -> (bf16[32000,2048]) {
  %state = (bf16[32000,2048], s8[5632,2048], s8[2048,5632], bf16[1,4,256,64], s64[]) parameter(0)
  %get-tuple-element.1 = bf16[32000,2048]{1,0:T(8,128)(2,1)} get-tuple-element(%state), index=0
  %get-tuple-element.2 = s8[5632,2048]{1,0:T(32,128)(4,1)} get-tuple-element(%state), index=1
  %get-tuple-element.3 = s8[2048,5632]{1,0:T(32,128)(4,1)} get-tuple-element(%state), index=2
  %get-tuple-element.4 = bf16[1,4,256,64]{2,3,1,0:T(8,128)(2,1)} get-tuple-element(%state), index=3
  %get-tuple-element.5 = s64[]{:T(128)} get-tuple-element(%state), index=4
  %custom-call.1 = u32[]{:T(128)} custom-call(%get-tuple-element.5), custom_call_target="X64SplitLow"
  %bitcast.1 = s32[]{:T(128)} bitcast(%custom-call.1)
  %fusion.1 = f32[1,2048]{1,0:T(1,128)S(1)} fusion(%get-tuple-element.1, %bitcast.1), kind=kLoop, calls=%fused_computation.1
  %fusion.2 = bf16[5632]{0:T(1024)(128)(2,1)S(1)} fusion(%get-tuple-element.2, %fusion.1), kind=kLoop, calls=%fused_computation.2
  %slice-start.1 = ((s8[2048,5632]{1,0:T(32,128)(4,1)}), s8[1024,5632]{1,0:T(32,128)(4,1)S(1)}, s32[]{:S(2)}) slice-start(%get-tuple-element.3), slice={[0:1024], [0:5632]}
  %slice-done.1 = s8[1024,5632]{1,0:T(32,128)(4,1)S(1)} slice-done(%slice-start.1)
  %copy-start.1 = (bf16[1,4,256,64]{2,3,1,0:T(8,128)(2,1)S(1)}, bf16[1,4,256,64]{2,3,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%get-tuple-element.4)
  %copy-done.1 = bf16[1,4,256,64]{2,3,1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start.1)
  %token.1 = bf16[1,4,1,64]{3,1,2,0:T(4,128)(2,1)S(1)} reshape(%fusion.2)
  %dynamic-update-slice.1 = bf16[1,4,256,64]{2,3,1,0:T(8,128)(2,1)S(1)} dynamic-update-slice(%copy-done.1, %token.1, %bitcast.1, %bitcast.1, %bitcast.1, %bitcast.1)
  ROOT %tuple.1 = (bf16[32000,2048]) tuple(%get-tuple-element.1)
}
ENTRY %main (p: (bf16[32000,2048], s8[5632,2048], s8[2048,5632], bf16[1,4,256,64], s64[])) -> (bf16[32000,2048]) {
  %p = (bf16[32000,2048], s8[5632,2048], s8[2048,5632], bf16[1,4,256,64], s64[]) parameter(0)
  ROOT %while.1 = (bf16[32000,2048]) while(%p), condition=%condition, body=%body
}
"""
    row, index, weight, prefetched = 2048 * 2, 4, 5632 * 2048, 1024 * 5632
    cache, token = 4 * 256 * 64 * 2, 4 * 64 * 2
    assert loop_body_traffic(text) == row + index + weight + prefetched + cache + 2 * token


def test_a_random_checkpoint_is_written_a_layer_a_file_and_stops_at_its_time_limit(tmp_path):
    import pytest

    from benchmarks.quant import write_random_checkpoint

    config = dict(chip.SIZES["tiny"]["model"], num_hidden_layers=2)
    written = write_random_checkpoint("llama", config, str(tmp_path), seconds=600)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert files == ["model-layer-000.safetensors", "model-layer-001.safetensors", "model-other.safetensors"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == written and len(index["weight_map"]) == 2 * 9 + 3
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path)  # Transformers reads it back whole
    assert sum(p.numel() * 2 for p in model.parameters()) == written
    with pytest.raises(TimeoutError, match="took over 0 s"):
        write_random_checkpoint("llama", config, str(tmp_path / "late"), seconds=0)


def test_first_call_phases_split_the_direct_trace_from_dynamos_capture(monkeypatch):
    """`compile`'s rows: a module compiled with the direct trace spends its first call in the Python trace and
    XLA, with next to nothing left as capture; through Dynamo (HF_TPU_COMPILE_DIRECT=0), the capture is the rest."""
    import torch

    import hf_tpu  # noqa: F401
    from hf_tpu import direct

    rows = []
    monkeypatch.setattr(chip._Rows, "emit",
                        lambda self, section, **figures: rows.append(dict(section=section, **figures)))
    x = torch.randn(4, 8, device="tpu")
    for direct_trace in ("1", "0"):
        monkeypatch.setenv("HF_TPU_COMPILE_DIRECT", direct_trace)
        direct.reset()
        torch._dynamo.reset()
        compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()).to("tpu"), backend="tpu")

        def forward():
            with torch.no_grad():
                compiled(x).cpu()

        chip._compile_row(chip._Rows("compile", False), "hf-tpu", "forward", forward, batch=4, length=8)
    traced, captured = rows
    assert traced["python_trace"] > 0 and traced["xla"] > 0 and traced["trace"] > 0
    assert captured["python_trace"] == 0 and captured["xla"] > 0 and captured["capture"] > traced["capture"]
    spec = chip.SIZES["tiny"]
    line = chip.describe(dict(traced, group="compile"), spec)
    assert line.startswith("[compile] hf-tpu forward 4x8: first call") and "Python trace" in line
    assert "first calls, where the time goes" in chip.report([dict(r, group="compile") for r in rows], spec)


def test_a_run_without_zstandard_says_its_first_calls_pay_for_zlib():
    """An install made without hf-tpu's dependencies (the chip's `pip install --no-deps`) leaves JAX compressing its
    disk cache with zlib: seconds of every first call that a user's install does not pay."""
    from benchmarks import chip

    run = {"section": "run", "size": "tiny", "batches": [1], "lengths": [16], "started": "now"}
    assert "zlib" in chip.describe(dict(run, zstandard=False), {})
    assert "zlib" not in chip.describe(dict(run, zstandard=True), {})
