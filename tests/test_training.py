"""Autograd and training on tpu, against the same steps on CPU."""

import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import hf_tpu
from tests.util import causal_lm_step


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _train(model, device, steps, mode="DEFER_NEVER"):
    torch.manual_seed(1)
    data = torch.randint(0, 128, (steps, 2, 16))
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    with torch.tpu.use_eager_mode(mode):
        for batch in data:
            batch = batch.to(device)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return torch.tensor(losses)


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_tiny_llama_trains_with_the_cpu_loss_curve(mode):
    import copy

    model = _tiny_llama()
    cpu = _train(copy.deepcopy(model), "cpu", 20)
    tpu = _train(model, "tpu", 20, mode)
    assert ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-4, (tpu, cpu)
    assert not hf_tpu.metrics()["cpu_fallbacks"]


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, foreach=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, foreach=False, amsgrad=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2, foreach=False),
        # fused: PyTorch accepts it for any PrivateUse1 device, and the Trainer asks for fused AdamW
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True, fused=True),
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, fused=True),
        lambda p: torch.optim.SGD(p, lr=0.1, fused=True),
        lambda p: (lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2, device=ps[0].device), fused=True))(list(p)),
    ],
)
def test_optimizers_match_cpu(make_opt):
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
        opt = make_opt(model.parameters())
        x = torch.randn(5, 6).to(device)
        for _ in range(4):
            model(x).square().mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
        return [p.detach().cpu() for p in model.parameters()]

    hf_tpu.reset_metrics()
    for a, b in zip(run("tpu"), run("cpu")):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert not hf_tpu.metrics()["cpu_fallbacks"]


def test_grad_scaler_and_a_fused_step_under_a_schedule_match_cpu():
    """`torch.amp.GradScaler` (unscaling, the inf check, the scale's back-off and growth) with fused AdamW
    and a learning-rate schedule: CPU's parameters and scale, no CPU fallback, and no compile per new
    learning rate."""

    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=2)
        x = torch.randn(5, 6).to(device)
        compiles = []
        for step in range(6):
            with torch.autocast(device_type=device, dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            if step == 1:  # an overflow: the step is skipped and the scale backs off
                next(model.parameters()).grad[0, 0] = float("inf")
            scaler.step(opt)
            scaler.update()
            schedule.step()
            opt.zero_grad()
            compiles.append(hf_tpu.metrics()["compiles"])
        return [p.detach().cpu() for p in model.parameters()], scaler.get_scale(), compiles

    hf_tpu.reset_metrics()
    (params, scale, compiles), (cpu_params, cpu_scale, _) = run("tpu"), run("cpu")
    assert scale == cpu_scale == 2.0**11  # backed off once (step 1), grew twice (steps 3 and 5)
    for a, b in zip(params, cpu_params):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert not hf_tpu.metrics()["cpu_fallbacks"]
    assert compiles[-1] == compiles[2]  # every program exists after three steps; new learning rates reuse them


def test_an_op_writing_lists_through_the_cpu_fallback():
    """Fused Adagrad has no lowering: the CPU fallback writes each of its lists back element by element."""
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).to(device)
        opt = torch.optim.Adagrad(model.parameters(), lr=0.1, fused=True)
        for _ in range(2):
            model(torch.ones(3, 4, device=device)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().cpu() for p in model.parameters()]

    hf_tpu.reset_metrics()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's warning, once per process
        for a, b in zip(run("tpu"), run("cpu")):
            torch.testing.assert_close(a, b)
    assert hf_tpu.metrics()["cpu_fallbacks"] == {"aten::_fused_adagrad_": 2}


def test_autograd_api():
    def run(device):
        x = torch.tensor([1.0, 2.0, 3.0], device=device, requires_grad=True)
        seen = []
        x.register_hook(lambda g: seen.append(g.detach().cpu()))
        y = (x ** 3).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), x, retain_graph=True)
        z = (x * 2).sum()
        z.backward(retain_graph=True)
        z.backward()
        with torch.no_grad():
            assert not (x * 2).requires_grad
        with torch.inference_mode():
            assert not (x * 2).requires_grad
        d = x.detach().requires_grad_()
        return g.detach().cpu(), gg.cpu(), x.grad.cpu(), len(seen), d.requires_grad

    cpu, tpu = run("cpu"), run("tpu")
    for a, b in zip(tpu, cpu):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_gradient_checkpointing_matches():
    def run(device):
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(), torch.nn.Linear(4, 4)).to(device)
        x = torch.randn(3, 4).to(device).requires_grad_()
        checkpoint(block, x, use_reentrant=False).sum().backward()
        return x.grad.cpu(), block[0].weight.grad.cpu()

    for a, b in zip(run("tpu"), run("cpu")):
        assert torch.allclose(a, b, atol=1e-6)


_CHECKPOINTED_DROPOUT = """
import torch, hf_tpu
from torch.utils.checkpoint import checkpoint

block = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 16)).to("tpu")
x = torch.randn(8, 16, device="tpu", requires_grad=True)
grads = []
for recompute in (None, False, True):  # plain, then checkpointed without and with reentrant autograd
    block.zero_grad()
    torch.manual_seed(123)
    y = block(x) if recompute is None else checkpoint(block, x, use_reentrant=recompute)
    y.square().sum().backward()
    grads.append(block[0].weight.grad.cpu())
print(all(torch.equal(grads[0], g) for g in grads[1:]))
"""


def test_a_checkpointed_dropout_recomputes_the_same_masks():
    """`torch.utils.checkpoint` restores a device's random state for the recomputation only once that
    device module says it is `_initialized`; it said so only after an explicit `torch.tpu.init()`. A
    fresh process, so no earlier test has called it."""
    import subprocess
    import sys

    from tests.util import cpu_process_env

    run = subprocess.run([sys.executable, "-c", _CHECKPOINTED_DROPOUT], capture_output=True, text=True, timeout=300,
                         env=cpu_process_env())
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "True"


def test_autocast_bfloat16():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    x = torch.randn(4, 8)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        expected = model(x)
    model.to("tpu")
    with torch.autocast(device_type="tpu", dtype=torch.bfloat16):
        actual = model(x.to("tpu"))
        assert actual.dtype == torch.bfloat16
        assert torch.softmax(actual, -1).dtype == torch.float32
        assert actual.sum().dtype == actual.sum(0).dtype == torch.float32  # CUDA's policy, every overload
    assert torch.allclose(actual.cpu().float(), expected.float(), atol=2e-2)
    actual.float().sum().backward()
    assert model[0].weight.grad.dtype == torch.float32


def test_autocast_runs_hf_tpus_attention_in_bfloat16_as_sdpa():
    """`hf_tpu::flash_attention` (Transformers' `attn_implementation="tpu"`) is a matmul-like op: under autocast it
    computes in bfloat16, as SDPA does on every device, from float32 queries (a float32 residual stream's rotary
    output) and bfloat16 values alike: the CPU's autocast SDPA within bfloat16's rounding."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.scaled_dot_product_attention(q, k, v.float(), is_causal=True, enable_gqa=True)
    with torch.autocast("tpu", dtype=torch.bfloat16):
        actual = torch.ops.hf_tpu.flash_attention(q.to("tpu"), k.to("tpu"), v.to("tpu"), None, is_causal=True)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual.cpu(), expected, rtol=2e-2, atol=2e-2)


def _trainer_losses(tmp_path, device, wrap=None, model_too=False, **arguments):
    """The logged losses of 3 Trainer steps of the tiny Llama (made into another model by `wrap`), and the model
    where `model_too`."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    AcceleratorState._reset_state(reset_partial_state=True)  # one Accelerate state per process
    torch.manual_seed(2)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (12, 16))]
    args = TrainingArguments(**dict(dict(
        output_dir=str(tmp_path / device), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=device == "cpu", seed=0, disable_tqdm=True),
        **arguments))
    model = _tiny_llama() if wrap is None else wrap(_tiny_llama())
    trainer = Trainer(model=model, args=args, train_dataset=data)
    assert trainer.accelerator.device.type == device
    trainer.train()
    assert trainer.model.device.type == device
    losses = torch.tensor([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    return (losses, trainer.model) if model_too else losses


def test_the_trainer_trains_on_tpu_with_the_cpu_losses(tmp_path):
    """Accelerate, which the Trainer trains through, knows no `tpu` backend: it moved the model back to
    the CPU while the Trainer sent its inputs to `tpu` (`integrations/accelerate/device.py`)."""
    cpu = _trainer_losses(tmp_path, "cpu")
    tpu = _trainer_losses(tmp_path, "tpu")
    assert len(tpu) == 3 and ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-4, (tpu, cpu)


@pytest.mark.parametrize("traced", [True, False])
def test_the_trainer_traces_its_micro_steps_and_its_optimizer_step(tmp_path, monkeypatch, caplog, traced):
    """The Trainer's `training_step` (forward, loss, backward; the gradients added to in place) is one traced
    program for every micro-batch, the zero gradients of each accumulation's first micro-batch another, the clipping
    a third and the optimizer's step a fourth: four programs for the whole run, the CPU's losses.
    `HF_TPU_TRAINER_TRACE=0` and `HF_TPU_OPTIMIZER_TRACE=0` run them eagerly, as the Trainer runs them."""
    if not traced:
        monkeypatch.setenv("HF_TPU_TRAINER_TRACE", "0")
        monkeypatch.setenv("HF_TPU_OPTIMIZER_TRACE", "0")
    import logging

    from hf_tpu import direct

    caplog.set_level(logging.INFO, logger="hf_tpu.integrations")
    cpu = _trainer_losses(tmp_path, "cpu", gradient_accumulation_steps=2, max_grad_norm=0.5)
    direct.reset()
    programs = hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)
    tpu = _trainer_losses(tmp_path, "tpu", gradient_accumulation_steps=2, max_grad_norm=0.5)
    assert hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0) - programs == (4 if traced else 0)
    assert "runs without hf_tpu.jit's trace" not in caplog.text
    told = "the Trainer's training_step runs eagerly on tpu, not as one traced program: HF_TPU_TRAINER_TRACE is off"
    assert caplog.text.count(told) == (0 if traced else 1)
    assert len(tpu) == 3 and ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-4, (tpu, cpu)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_trainer_step_launches_no_op_per_parameter_and_compiles_nothing_after_its_second(tmp_path, accumulation):
    """A step of the Trainer on tpu launches its programs and a few eager ops (the loss's sum, the counts of the
    next batches' labels, the schedule's new rate), as many for a model of 1 layer as of 3: the gradients
    `zero_grad()` drops were made again before each micro step by an op per parameter, each array then copied by the
    micro step before it could take it (a factory's arrays are not committed to their device), 2 x 147 launches a
    step for the 1.1B.
    Without accumulation the micro step's program makes the gradients; with it one program makes them all. From
    the third step on, with the learning rate changing at every step, nothing compiles."""
    from accelerate.state import AcceleratorState
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_tpu import direct

    class Counts(TrainerCallback):
        def __init__(self):
            self.at_step_end = []

        def on_step_end(self, args, state, control, **kwargs):
            self.at_step_end.append(hf_tpu.metrics())

    def steps(layers):
        AcceleratorState._reset_state(reset_partial_state=True)
        direct.reset()
        config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
        torch.manual_seed(0)
        data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (10 * accumulation, 8))]
        args = TrainingArguments(str(tmp_path / str(layers)), per_device_train_batch_size=2, max_steps=5,
                                 gradient_accumulation_steps=accumulation, logging_steps=1, report_to=[],
                                 save_strategy="no", seed=0, disable_tqdm=True, dataloader_pin_memory=False)
        counts = Counts()
        programs = hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)
        Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=data, callbacks=[counts]).train()
        assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] - programs == (3 if accumulation == 1 else 4)
        after = counts.at_step_end
        assert [b["xla_compiles"] - a["xla_compiles"] for a, b in zip(after[1:], after[2:])] == [0, 0, 0]
        return [b["ops_dispatched"] - a["ops_dispatched"] for a, b in zip(after[1:], after[2:])]

    one, three = steps(1), steps(3)
    assert one == three, (one, three)


def test_a_trainer_step_reads_the_host_only_for_what_it_logs_and_filters_nan_losses_as_on_the_cpu(tmp_path):
    """The Trainer checks each micro-batch's loss for NaN or infinity (`logging_nan_inf_filter`, on by default) on
    the host: it waited there for each micro step's program before launching the next, the chip idle meanwhile.
    On tpu the micro step's program filters the loss itself: between two steps the host reads only what the Trainer
    logs (the learning rate, the loss, the gradient norm), and a NaN loss is logged as the CPU's Trainer logs it
    (the mean of the logged loss before it in its place); the user's arguments keep the filter on, and a checkpoint
    saves them so."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class NaNWhereTheBatchStartsWithZero(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            return torch.where(inputs["input_ids"][0, 0] == 0, torch.nan, loss)

    class Syncs(TrainerCallback):
        def __init__(self):
            self.at_step_end = []

        def on_step_end(self, args, state, control, **kwargs):
            self.at_step_end.append(hf_tpu.metrics()["host_syncs"])

    def run(device):
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.manual_seed(2)
        ids = torch.randint(1, 128, (16, 16))
        ids[2, 0] = ids[4, 0] = 0  # the second micro-batch's loss and the third's: NaN
        args = TrainingArguments(str(tmp_path / device), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                 max_steps=4, learning_rate=1e-3, logging_steps=1, report_to=[], save_steps=3,
                                 use_cpu=device == "cpu", seed=0, disable_tqdm=True, dataloader_pin_memory=False,
                                 train_sampling_strategy="sequential")
        syncs = Syncs()
        trainer = NaNWhereTheBatchStartsWithZero(model=_tiny_llama(), args=args, callbacks=[syncs],
                                                 train_dataset=[{"input_ids": row, "labels": row} for row in ids])
        trainer.train()
        saved = torch.load(tmp_path / device / "checkpoint-3" / "training_args.bin", weights_only=False)
        assert args.logging_nan_inf_filter and saved.logging_nan_inf_filter
        return torch.tensor([entry["loss"] for entry in trainer.state.log_history if "loss" in entry]), \
            syncs.at_step_end

    cpu, _ = run("cpu")
    tpu, syncs = run("tpu")
    assert len(tpu) == 4 and torch.isfinite(tpu).all(), tpu
    assert ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-4, (tpu, cpu)
    assert [b - a for a, b in zip(syncs, syncs[1:])][:2] == [3, 3]  # the third step's include its checkpoint


def test_an_accumulation_windows_zero_gradients_are_added_to_where_they_lie():
    """The zero gradients the Trainer gets before each accumulation window's first micro-batch come out of one
    program that reads no input (`trainer._traced_gradients_made`), so JAX leaves them uncommitted to their device;
    the micro step commits each where it lies and adds to it in place (donated). It copied every one first: a
    second write and read of all the gradients every optimizer step (3.7 GB for the 0.44B in float32)."""
    from hf_tpu.integrations.transformers import trainer
    from hf_tpu.memory import buffer

    def address(t):
        return buffer.buffer_of(t).value().unsafe_buffer_pointer()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to("tpu")
    parameters = list(model.parameters())

    @hf_tpu.jit
    def micro_step(x):
        model(x).square().mean().backward()

    for _ in range(2):
        trainer._traced_gradients_made(parameters)
        zeros = [address(p.grad) for p in parameters]
        micro_step(torch.randn(2, 6).to("tpu"))
        assert [address(p.grad) for p in parameters] == zeros
        assert all(p.grad.abs().sum().item() > 0 for p in parameters)
        model.zero_grad()


def _right_padded(features):
    """A collator as a user writes one for sequences of several lengths: padded on the right to the batch's longest,
    labels -100 and mask 0 where padded."""
    longest = max(len(f["input_ids"]) for f in features)
    batch = {"input_ids": torch.zeros(len(features), longest, dtype=torch.long),
             "labels": torch.full((len(features), longest), -100), "attention_mask": torch.zeros(len(features), longest,
                                                                                                 dtype=torch.long)}
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        batch["input_ids"][row, :n] = batch["labels"][row, :n] = f["input_ids"]
        batch["attention_mask"][row, :n] = 1
    return batch


def test_the_trainer_pads_a_causal_lms_batches_to_their_bucket_with_the_cpu_losses(tmp_path):
    """Batches of 11 to 16 tokens (one bucket) make one micro step's program on tpu, where each length traced and
    compiled its own; the padding changes no loss. A Trainer whose `compute_loss` is its own is not padded."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from hf_tpu import direct

    def losses(device, trainer_class=Trainer):
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.manual_seed(2)
        data = [{"input_ids": torch.randint(0, 128, (length,))} for length in (16, 11, 13, 15, 12, 16, 14, 11)]
        args = TrainingArguments(str(tmp_path / device), per_device_train_batch_size=2, max_steps=4,
                                 learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no",
                                 use_cpu=device == "cpu", seed=0, disable_tqdm=True, dataloader_pin_memory=False)
        trainer = trainer_class(model=_tiny_llama(), args=args, train_dataset=data, data_collator=_right_padded)
        trainer.train()
        return torch.tensor([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, **kwargs):
            return super().compute_loss(model, inputs, **kwargs)

    cpu = losses("cpu")
    direct.reset()
    programs = hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)
    tpu = losses("tpu")
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] - programs == 3  # the micro step's, clipping's, optimizer's
    assert len(tpu) == 4 and ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-4, (tpu, cpu)
    direct.reset()
    programs = hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)
    losses("tpu", OwnLoss)
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] - programs > 3


def test_the_trainers_mixed_precision_checkpointed_recipe_traces_with_the_cpu_losses(tmp_path):
    """`bf16=True` (autocast inside the traced step), `gradient_checkpointing=True` (the recomputation in the same
    program) and accumulation: still a micro step's program, the zero gradients', the clipping's and the
    optimizer's, the CPU's losses within bfloat16 autocast's rounding of other orders of the same sums."""
    from hf_tpu import direct

    arguments = dict(bf16=True, gradient_checkpointing=True, gradient_accumulation_steps=2)
    cpu = _trainer_losses(tmp_path, "cpu", **arguments)
    direct.reset()
    programs = hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)
    tpu = _trainer_losses(tmp_path, "tpu", **arguments)
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] - programs == 4
    assert len(tpu) == 3 and ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-3, (tpu, cpu)


def test_the_trainer_trains_lora_adapters_in_traced_steps_with_the_cpu_losses(tmp_path):
    """PEFT LoRA through the Trainer: the frozen weights are inputs that take no gradient, the adapters' gradients
    their clipping and AdamW's step are the programs of every step, beside the zero gradients of each accumulation (the
    optimizer's empty group of parameters without weight decay has a tensor rate, else each scheduled rate keyed a
    program of its own), the CPU's losses; only the adapters change, and they save and load back."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from hf_tpu import direct

    def lora(model):
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    arguments = dict(gradient_accumulation_steps=2, learning_rate=1e-2)
    cpu = _trainer_losses(tmp_path, "cpu", wrap=lora, **arguments)
    direct.reset()
    programs = hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)
    tpu, model = _trainer_losses(tmp_path, "tpu", wrap=lora, model_too=True, **arguments)
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] - programs == 4
    assert len(tpu) == 3 and ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-4, (tpu, cpu)
    untouched = _tiny_llama().state_dict()
    for name, weight in model.base_model.model.state_dict().items():
        if "lora_" not in name:
            assert torch.equal(weight.cpu(), untouched[name.replace(".base_layer", "")]), name
    model.save_pretrained(tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(_tiny_llama(), tmp_path / "adapter")
    trained = {k: v.cpu() for k, v in model.state_dict().items() if "lora_" in k}
    assert trained and all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.items())


def test_a_checkpointed_lora_models_layers_scan_in_the_trainers_micro_step_with_the_unrolled_losses(tmp_path,
                                                                                                    monkeypatch):
    """PEFT's LoRA layers keep the keyword arguments they were made with, their own name among them: the decoder's
    layers differed in that and ran unrolled in the Trainer's checkpointed micro step (the 1.1B's 22 layers: 67.5 s
    of XLA on the v5e). They scan, with the unrolled step's losses and adapters; not where the adapter layer's code
    reads that record."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    from hf_tpu import direct, layer_scan
    from hf_tpu.integrations.transformers import configure, scanned_layers
    from hf_tpu.integrations.transformers.settings import settings

    class ReadsItsRecord(LoraLinear):
        def forward(self, x, *args, **kwargs):
            return super().forward(x, *args, **kwargs) * len(self.kwargs["target_name"])

    assert scanned_layers._peft_record_unread(LoraLinear) and not scanned_layers._peft_record_unread(ReadsItsRecord)

    def run(scan_layers):
        previous = settings.scan_layers
        configure(scan_layers=scan_layers)
        try:
            direct.reset()
            return _trainer_losses(tmp_path, "tpu", wrap=lora, model_too=True, gradient_checkpointing=True,
                                   learning_rate=1e-2)
        finally:
            configure(scan_layers=previous)

    def lora(model):
        return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))

    unrolled, unrolled_model = run("off")
    scans = []
    forward = layer_scan._ScannedLayers.forward
    monkeypatch.setattr(layer_scan._ScannedLayers, "forward",
                        staticmethod(lambda *args: scans.append(1) or forward(*args)))
    scanned, scanned_model = run("checkpointed")
    assert scans == [1]  # the micro step's one trace scans the layers
    torch.testing.assert_close(scanned, unrolled, rtol=1e-6, atol=1e-6)
    adapters = {name: p.detach().cpu() for name, p in scanned_model.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in name for name in adapters)
    for name, p in unrolled_model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(adapters[name], p.detach().cpu(), rtol=1e-6, atol=1e-6)


def test_the_trainer_compiles_for_tpu_with_the_cpu_losses(tmp_path, monkeypatch, caplog):
    """`torch_compile=True` left Transformers to pick Inductor, which cannot compile for tpu, and Accelerate knew no
    `tpu` backend to name instead. With the `tpu` backend the compiled model runs inside the traced micro step, each
    micro-batch's forward and backward one program, as without `torch_compile`: the micro steps ran eagerly around
    Dynamo's graphs, 1.8x slower on the chip, and the model's walk for the trace's key failed on the
    `OptimizedModule` that wraps it (it holds no `training` of its own)."""
    import logging

    from accelerate.utils import TorchDynamoPlugin
    from torch._dynamo.utils import counters

    from hf_tpu import compiled_modules, direct, modes

    assert TorchDynamoPlugin(backend="tpu").to_kwargs()["backend"] == "tpu"
    caplog.set_level(logging.INFO, logger="hf_tpu.integrations")
    cpu = _trainer_losses(tmp_path, "cpu")
    compiled_calls = []
    call = compiled_modules._CompiledCall.__call__

    def noted(self, args, kwargs):
        compiled_calls.append(modes.current().kind)
        return call(self, args, kwargs)

    monkeypatch.setattr(compiled_modules._CompiledCall, "__call__", noted)
    direct.reset()
    before, graphs = hf_tpu.metrics(), counters["stats"]["unique_graphs"]
    tpu = _trainer_losses(tmp_path, "tpu", torch_compile=True)
    after = hf_tpu.metrics()
    # the compiled model was called, and only inside a trace: the micro step's, traced once for its three steps
    assert compiled_calls == [modes.ModeKind.TRACE]
    assert counters["stats"]["unique_graphs"] == graphs  # no graph of Dynamo's
    # the micro step's, the clipping's and the optimizer's programs, each compiled once and run at every step
    assert after["compiles_by_mode"]["COMPILE"] - before["compiles_by_mode"].get("COMPILE", 0) == 3
    assert after["programs_launched"] - before["programs_launched"] == 9
    assert "runs eagerly" not in caplog.text and "runs without hf_tpu.jit's trace" not in caplog.text
    assert len(tpu) == 3 and ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-4, (tpu, cpu)


def test_the_trainer_compiled_with_another_backend_runs_dynamos_graphs(tmp_path, caplog):
    """A backend the user names (`torch_compile_backend`) is theirs: the micro steps run eagerly around Dynamo's
    graphs compiled by it, saying so, with the CPU's losses."""
    import logging

    from torch._dynamo.utils import counters

    caplog.set_level(logging.INFO, logger="hf_tpu.integrations")
    cpu = _trainer_losses(tmp_path, "cpu")
    graphs = counters["stats"]["unique_graphs"]
    tpu = _trainer_losses(tmp_path, "tpu", torch_compile=True, torch_compile_backend="eager")
    assert counters["stats"]["unique_graphs"] > graphs
    assert caplog.text.count("runs eagerly on tpu, not as one traced program: torch_compile_backend='eager'") == 1
    assert len(tpu) == 3 and ((tpu - cpu).abs() / cpu.abs()).max().item() < 1e-4, (tpu, cpu)


def test_an_accelerator_prepares_for_tpu():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator()
        assert accelerator.device == torch.device("tpu", 0)
        model = accelerator.prepare(torch.nn.Linear(4, 2))
        assert model.weight.device.type == "tpu"
        loader = accelerator.prepare(torch.utils.data.DataLoader(torch.randn(4, 4), batch_size=2))
        assert all(batch.device.type == "tpu" for batch in loader)
        AcceleratorState._reset_state(reset_partial_state=True)
        assert Accelerator(cpu=True).device == torch.device("cpu")
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _accelerate_losses(device, traced_step):
    """The losses of an Accelerate loop over the tiny Llama (clipping, AdamW, a schedule stepped outside the step);
    with `traced_step`, the user's step is traced whole by `hf_tpu.jit`."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator(cpu=device == "cpu")
        torch.manual_seed(2)
        loader = torch.utils.data.DataLoader(torch.randint(0, 128, (8, 16)), batch_size=2)
        model = _tiny_llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
        model, opt, loader, schedule = accelerator.prepare(model, opt, loader, schedule)

        def step(ids):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            return loss.detach()

        step = hf_tpu.jit(step) if traced_step else step
        losses = []
        for ids in loader:
            losses.append(step(ids).item())
            schedule.step()
        return torch.tensor(losses)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("traced_step", [False, True])
def test_an_accelerate_loop_steps_its_optimizer_in_one_program_with_the_cpu_losses(caplog, traced_step):
    """A plain Accelerate loop: `accelerator.clip_grad_norm_()` and `optimizer.step()` (AcceleratedOptimizer's) are
    one traced program each; the user's whole step traced by `hf_tpu.jit` is one program with the clipping and the
    optimizer's step inside it (a jitted function called inside a trace is part of its program, and the optimizer
    the AcceleratedOptimizer holds gets its state before the first trace); the CPU's losses either way."""
    from hf_tpu import direct

    cpu = _accelerate_losses("cpu", traced_step=False)
    direct.reset()
    programs = hf_tpu.metrics()["compiles_by_mode"].get("COMPILE", 0)
    tpu = _accelerate_losses("tpu", traced_step)
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] - programs == (1 if traced_step else 2)
    assert "runs without hf_tpu.jit's trace" not in caplog.text
    torch.testing.assert_close(tpu, cpu, rtol=1e-4, atol=1e-4)


def test_an_accelerator_checkpoint_restores_the_tpu_random_state(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        accelerator = Accelerator()
        torch.manual_seed(0)
        accelerator.save_state(str(tmp_path))
        drawn = torch.rand(4, device="tpu").cpu()
        accelerator.load_state(str(tmp_path))
        assert torch.equal(torch.rand(4, device="tpu").cpu(), drawn)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_a_resumed_trainer_draws_the_dropout_of_the_uninterrupted_run(tmp_path):
    """The Trainer's checkpoint keeps the RNG of the devices Transformers knows; without the tpu's, a
    resumed run's dropout masks (and so its losses) were not the uninterrupted run's."""
    from accelerate.state import AcceleratorState
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    def train(resume=None):
        AcceleratorState._reset_state(reset_partial_state=True)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, vocab_size=64, attention_dropout=0.5))
        data = [{"input_ids": ids, "labels": ids}
                for ids in torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))]
        args = TrainingArguments(str(tmp_path), max_steps=4, save_steps=2, per_device_train_batch_size=2,
                                 logging_steps=1, report_to=[], disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        assert trainer.args.device.type == "tpu"
        trainer.train(resume_from_checkpoint=resume)
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry][-2:]

    uninterrupted = train()
    assert train(resume=str(tmp_path / "checkpoint-2")) == uninterrupted


def test_a_configuration_that_sends_accelerate_to_the_cpu_says_so_once(monkeypatch):
    """`accelerate config default` writes `use_cpu: true` without CUDA, and training then ran on the CPU
    without a word while a tpu was there."""
    import warnings

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from hf_tpu.integrations.accelerate import device as adapter

    monkeypatch.setattr(adapter, "_told", [])
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monkeypatch.setenv("ACCELERATE_USE_CPU", "true")  # what `accelerate launch` sets for use_cpu
            assert Accelerator().device == torch.device("cpu")
            AcceleratorState._reset_state(reset_partial_state=True)
            assert Accelerator(cpu=True).device == torch.device("cpu")
        told = [w for w in caught if "runs on the CPU although a tpu is available" in str(w.message)]
        assert len(told) == 1
        monkeypatch.delenv("ACCELERATE_USE_CPU")
        AcceleratorState._reset_state(reset_partial_state=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            monkeypatch.setattr(adapter, "_told", [])
            assert Accelerator().device == torch.device("tpu", 0)
        assert not [w for w in caught if "runs on the CPU" in str(w.message)]
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


# --- A training step traced into one program (`hf_tpu.jit`): autograd over the trace's tensors


def _traced_training(device, steps, make_opt, checkpointing=None, dropout=0.0, jit=True, schedule=False, length=8):
    """Losses of `steps` steps (forward, backward, optimizer step) of the tiny Llama, each step traced whole by
    `hf_tpu.jit` where `jit`; and the model's parameters after them. The programs traced before are forgotten:
    a module's attributes other than `training` (which checkpoint function it calls) are not part of their key."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_tpu import direct

    direct.reset()

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, attention_dropout=dropout)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    model.train().to(device)
    opt = make_opt(model.parameters())
    lrs = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step)) if schedule else None

    step = causal_lm_step(model, opt, jit)
    data = torch.randint(0, 64, (steps, 2, length), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(5)
    losses = []
    for ids in data:
        losses.append(step(ids.to(device)).item())
        if lrs is not None:
            lrs.step()
    return torch.tensor(losses), [p.detach().cpu() for p in model.parameters()]


def test_a_training_step_traces_into_one_program_with_the_cpu_losses(caplog):
    """Forward, backward and AdamW's step in one program per call: the model and the optimizer (found among the
    function's closure) are its state, the moments AdamW makes at its first step are made before it (as its
    `_init_group` makes them), so every step runs one program, and the gradients never leave it; a learning-rate
    schedule changes no program."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)

    cpu, cpu_params = _traced_training("cpu", 4, adamw, jit=False, schedule=True)
    tpu, tpu_params = _traced_training("tpu", 4, adamw, schedule=True)
    torch.testing.assert_close(tpu, cpu, rtol=1e-5, atol=1e-5)
    # AdamW divides by the gradient's running size: an entry whose gradients are float32 noise (another order
    # of the same sums) moves by a part of the learning rate either way
    for a, b in zip(tpu_params, cpu_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-3)
    metrics = hf_tpu.metrics()
    assert metrics["compiles_by_mode"]["COMPILE"] == 1 and not metrics["cpu_fallbacks"]
    assert "runs without hf_tpu.jit's trace" not in caplog.text


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_traced_step_recomputes_behind_a_barrier_with_the_forward_draws(reentrant):
    """`gradient_checkpointing_enable()` inside a traced step: the recomputed forward takes its inputs through an
    optimization barrier (else XLA merges it with the forward and keeps every activation), and its dropout draws
    what the forward drew: the traced steps' losses and parameters are eager tpu's."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)

    eager, eager_params = _traced_training("tpu", 2, adamw, checkpointing=reentrant, dropout=0.5, jit=False)
    traced, traced_params = _traced_training("tpu", 2, adamw, checkpointing=reentrant, dropout=0.5)
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(traced_params, eager_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_recomputed_attention_meets_the_masks_its_forward_met():
    """The trace runs under a torch function mode that gives attention a causal mask's pattern; PyTorch takes it off
    while `loss.backward()` runs, and a non-reentrant checkpoint's recomputed attention took the mask's other path,
    saving other tensors than its forward: the checkpoint's refusal aborted the process inside autograd's engine."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)

    eager, eager_params = _traced_training("tpu", 2, adamw, checkpointing=False, jit=False, length=32)
    traced, traced_params = _traced_training("tpu", 2, adamw, checkpointing=False, length=32)
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(traced_params, eager_params):  # AdamW's step on float32 noise: a part of the learning rate
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_barrier_stands_before_each_recomputed_layer():
    from hf_tpu import remat

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()).to("tpu")

    def step(x):
        checkpoint(block, x, use_reentrant=False).sum().backward()
        checkpoint(block, x, use_reentrant=True).sum().backward()
        return x.grad.detach()

    x = torch.randn(2, 4, device="tpu", requires_grad=True)
    text = hf_tpu.jit(step).lower(x).as_text()
    assert text.count("optimization_barrier") == 2
    assert remat.behind_barrier([x, 1]) == [x, 1]  # outside a trace: as they are


def test_a_value_the_forward_saves_passes_a_barrier_and_a_parameter_does_not():
    """A value autograd saves outside a checkpointed block is kept from the forward behind a barrier: without it the
    v5e's compiler recomputed a Llama's saved final-norm input in the backward from each layer's residual addends,
    holding two float32 activations a layer from the forward to the loss's backward (`hf_tpu.remat`). A parameter,
    and a linear layer's transposed weight, an input of the program, stays out of it (a view behind a barrier
    would be a copy of the weight)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4).to("tpu")

    def step(x):
        torch.tanh(layer(x)).sum().backward()  # the linear layer saves x and the weight; tanh its result
        return layer.weight.grad.detach()

    x = torch.randn(2, 4, device="tpu")
    text = hf_tpu.jit(step).lower(x).as_text()
    assert text.count("optimization_barrier") == 1  # tanh's result alone
    traced = hf_tpu.jit(step)(x).cpu()
    layer.weight.grad = None
    torch.testing.assert_close(traced, step(x).cpu())


def test_gradients_accumulate_in_a_traced_micro_step_without_leaving_the_device():
    """Gradient accumulation: a traced forward and backward sets `.grad` at its first call (an output of the program)
    and adds to it in place at the next (an input it overwrites, donated); the optimizer's step traced apart."""
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)

        def micro_step(x):
            loss = model(x).square().mean() / 4
            loss.backward()
            return loss.detach()

        def optimizer_step():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()

        if device == "tpu":
            micro_step, optimizer_step = hf_tpu.jit(micro_step), hf_tpu.jit(optimizer_step)
        data = torch.randn(2, 4, 5, 6, generator=torch.Generator().manual_seed(3))
        for window in data:
            for x in window:
                micro_step(x.to(device))
            optimizer_step()
        return [p.detach().cpu() for p in model.parameters()]

    hf_tpu.reset_metrics()
    for a, b in zip(run("tpu"), run("cpu")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # programs: the micro step setting `.grad` and the one adding to it, the optimizer's step
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] == 3


def test_an_optimizer_that_makes_its_state_in_its_step_adds_it_from_the_first_trace():
    """SGD makes its momentum in the step (from the gradient): the first traced step's program makes it, the call
    adds it to the optimizer's state, and the next call traces the program that reads it."""
    def run(device):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)

        def step(x):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

        step = hf_tpu.jit(step) if device == "tpu" else step
        for x in torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(1)):
            step(x.to(device))
        return [p.detach().cpu() for p in model.parameters()], opt.state[model.weight]["momentum_buffer"].cpu()

    hf_tpu.reset_metrics()
    (params, momentum), (cpu_params, cpu_momentum) = run("tpu"), run("cpu")
    for a, b in zip([*params, momentum], [*cpu_params, cpu_momentum]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert hf_tpu.metrics()["compiles_by_mode"]["COMPILE"] == 2


def test_the_second_traced_step_runs_the_first_steps_compiled_program():
    """AdamW's moments and step counts, made by `torch.zeros` before the first trace, were arrays not committed to
    their device; the first step's results that replace them are, and JAX keys a jitted function by that: the
    second step lowered and compiled the whole program again (as long as the first step's compile)."""
    from hf_tpu import direct, trace_program

    direct.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step = hf_tpu.jit(step)
    for _ in range(3):
        step(torch.randn(4, 8, device="tpu"))
    (program,) = [p for p in direct._programs.values() if isinstance(p, trace_program.Program)]
    assert program.jitted[True]._cache_size() == 1


def test_parameters_sharing_an_uploaded_value_are_donated_to_the_traced_step():
    """Equal small values are uploaded once and shared (two norms' weights, all ones): a traced step that overwrites
    them donated nothing, holding every parameter and moment twice, until each got an array of its own."""
    from hf_tpu import direct

    model = torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(x):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    x = torch.randn(4, 8, device="tpu")
    analysis = direct.lower(step, (x,), {}).compile().memory_analysis()
    written = sum(p.nbytes for p in model.parameters()) + sum(
        t.nbytes for state in opt.state.values() for t in state.values())
    assert analysis.alias_size_in_bytes == written
    step(x)
    assert not torch.equal(model[0].weight.detach().cpu(), torch.ones(8))
    assert torch.equal(torch.nn.LayerNorm(8).to("tpu").weight.detach().cpu(), torch.ones(8))  # the shared value kept


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpointed_decoder_scans_its_layers_with_the_unrolled_steps_results(reentrant, monkeypatch):
    """Once checkpointed, a decoder's layers run as one scanned loop in the traced step (`scanned_layers`): the
    losses and parameters of the step with its layers unrolled (`scan_layers="off"`), and the scan is taken."""
    from hf_tpu import layer_scan
    from hf_tpu.integrations.transformers import configure
    from hf_tpu.integrations.transformers.settings import settings

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, foreach=True)

    previous = settings.scan_layers
    configure(scan_layers="off")
    try:
        unrolled, unrolled_params = _traced_training("tpu", 2, adamw, checkpointing=reentrant, length=16)
    finally:
        configure(scan_layers=previous)
    scans = []
    forward = layer_scan._ScannedLayers.forward
    monkeypatch.setattr(layer_scan._ScannedLayers, "forward",
                        staticmethod(lambda *args: scans.append(1) or forward(*args)))
    scanned, scanned_params = _traced_training("tpu", 2, adamw, checkpointing=reentrant, length=16)
    assert scans == [1]  # one trace, one scan of the layers
    torch.testing.assert_close(scanned, unrolled, rtol=1e-6, atol=1e-6)
    for a, b in zip(scanned_params, unrolled_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_only_a_plain_loop_over_the_layers_is_scanned(tmp_path):
    """The loop's body must be `hidden = layer(hidden, ...)` with arguments that do not name the layer (Gemma 3 picks
    each layer's mask by its type); outside a traced step the list iterates over its layers; a model loaded on tpu
    (whose layers hold Transformers' output-capturing hooks, inert unless a call records outputs) scans too."""
    from transformers import Gemma3TextModel, LlamaConfig, LlamaForCausalLM, LlamaModel

    from hf_tpu.integrations.transformers import scanned_layers

    assert scanned_layers._plain_loop(LlamaModel) and not scanned_layers._plain_loop(Gemma3TextModel)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, device_map="tpu")
    assert type(model.model.layers) is scanned_layers.ScannableLayers
    assert list(model.model.layers) == list(model.model.layers._modules.values())
    model.gradient_checkpointing_enable()
    model.train()
    layers = list(model.model.layers._modules.values())
    assert scanned_layers._hooks_inert(layers) and layers[0]._forward_hooks
    ids = torch.randint(0, 64, (2, 8)).to("tpu")
    hf_tpu.direct.reset()
    text = causal_lm_step(model, torch.optim.SGD(model.parameters(), lr=0.1), jit=True).lower(ids).as_text()
    assert text.count("stablehlo.while") >= 2


def test_a_layer_that_computes_with_its_index_is_not_scanned():
    """The layers may differ in `layer_idx` only where it reaches nothing but a cache: a layer whose forward computes
    with it runs unrolled, with its own index."""
    from hf_tpu.integrations.transformers import scanned_layers
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer

    class ScaledByIndex(torch.nn.Module):
        def __init__(self, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, hidden, **kwargs):
            return self.linear(hidden) / (self.layer_idx + 1)

    assert scanned_layers._index_only_for_caches(LlamaDecoderLayer)
    assert scanned_layers._index_only_for_caches(LlamaAttention)
    assert not scanned_layers._index_only_for_caches(ScaledByIndex)
    torch.manual_seed(0)
    layers = [ScaledByIndex(k).to("tpu") for k in range(3)]
    x = torch.randn(2, 4).to("tpu")

    def forward(x):
        return scanned_layers._LayerStack(layers)(x).detach()

    expected = x
    for layer in layers:
        expected = layer(expected)
    hf_tpu.direct.reset()
    jitted = hf_tpu.jit(forward)
    torch.testing.assert_close(jitted(x).cpu(), expected.detach().cpu())
    assert jitted.lower(x).as_text().count("stablehlo.while") == 0
