"""Sentence Transformers on tpu: batches of varying length padded to bucket lengths, so that new lengths
compile nothing new, with the CPU's embeddings."""

import pytest
import torch

import hf_tpu
from hf_tpu.integrations import sentence_transformers as adapter

sentence_transformers = pytest.importorskip("sentence_transformers")

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path = tmp_path_factory.mktemp("tiny-bert")
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).save_pretrained(path)
    return path


def _model(checkpoint, device):
    from sentence_transformers import SentenceTransformer, models

    encoder = models.Transformer(str(checkpoint), max_seq_length=128)
    pooling = models.Pooling(encoder.get_embedding_dimension(), pooling_mode="mean")
    return SentenceTransformer(modules=[encoder, pooling], device=device)


def _sentences(lengths):
    return [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(n)) for i, n in enumerate(lengths)]


@pytest.fixture
def on_the_device_only(monkeypatch):
    """The adapter's traced forward without its host runs (`meanwhile`): every batch traces and waits for its
    bucket's compile, so that what a test counts is the device's programs."""
    monkeypatch.setattr(adapter, "_traced_model_forward", hf_tpu.jit(adapter._model_forward))


def test_new_lengths_within_the_buckets_compile_nothing_with_the_cpu_embeddings(checkpoint, on_the_device_only):
    cpu, tpu = _model(checkpoint, "cpu"), _model(checkpoint, "tpu")
    first = _sentences([3, 9, 5, 12, 20, 25, 17, 28])  # batches of 4, padded to 16 and 32 tokens
    tpu.encode(first, batch_size=4)
    hf_tpu.reset_metrics()
    second = _sentences([2, 7, 11, 4, 22, 26, 19, 29])  # each batch of another length than before
    actual = tpu.encode(second, batch_size=4)  # each batch read back to the host
    assert hf_tpu.metrics()["compiles"] == 0
    expected = cpu.encode(second, batch_size=4)
    torch.testing.assert_close(torch.from_numpy(actual), torch.from_numpy(expected), rtol=1e-5, atol=1e-5)


def test_token_embeddings_are_the_unpadded_ones(checkpoint):
    cpu, tpu = _model(checkpoint, "cpu"), _model(checkpoint, "tpu")
    sentences = _sentences([3, 7])
    expected = cpu.encode(sentences, output_value="token_embeddings")
    actual = tpu.encode(sentences, output_value="token_embeddings")
    assert [a.shape for a in actual] == [e.shape for e in expected]
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, longest, padded", [(5, None, 16), (16, None, 16), (17, 128, 32), (33, 128, 48), (100, 64, 100),
                                                     (9000, None, 9000)])
def test_bucketed_length(length, longest, padded):
    assert adapter.bucketed_length(length, longest) == padded


def test_buckets_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("HF_TPU_ENCODE_BUCKETS", "")
    assert adapter.bucketed_length(5, None) == 5
    monkeypatch.setenv("HF_TPU_ENCODE_BUCKETS", "8, 24")
    assert adapter.bucketed_length(5, None) == 8 and adapter.bucketed_length(9, None) == 24
    monkeypatch.setenv("HF_TPU_ENCODE_BUCKETS", "8,-1")
    with pytest.raises(ValueError, match="HF_TPU_ENCODE_BUCKETS"):
        adapter.bucketed_length(5, None)


def test_the_model_runs_as_one_program_per_batch_shape(checkpoint, monkeypatch, on_the_device_only):
    """Without gradients the model's forward (encoder, pooling, normalisation) is traced into one program
    (`hf_tpu.jit`): a warm batch dispatches no op of its own (only the program), where op by op it dispatches
    every op of every layer, and a first pass compiles one program per batch shape."""
    tpu = _model(checkpoint, "tpu")
    sentences = _sentences([3, 9, 5, 12])

    def ops_of_a_warm_encode():
        tpu.encode(sentences, batch_size=4)
        hf_tpu.reset_metrics()
        tpu.encode(sentences, batch_size=4)
        return hf_tpu.metrics()["ops_dispatched"]

    traced = ops_of_a_warm_encode()
    monkeypatch.setattr(adapter, "_traced_model_forward", adapter._model_forward)  # op by op
    assert traced == 0 and ops_of_a_warm_encode() > 20, traced


def test_a_bucket_runs_on_the_host_in_pytorch_until_the_device_has_compiled_it(checkpoint, monkeypatch):
    """The adapter's traced forward runs a batch in PyTorch on the host's CPU while its bucket's program is not
    compiled (`hf_tpu.jit(meanwhile=)`; the device's compile held back here). A bucket is traced, and its
    compile started, once its batches have spent on the host `trace_after` seconds (before the model's first
    trace; then as long as that trace took; each batch takes 10 s of the test's clock here), and once compiled
    the batches run the program. The embeddings are the CPU's all along; the weights are copied to the host
    once."""
    import concurrent.futures

    from hf_tpu import compile_log, direct

    held = []

    def in_background(work):
        held.append((work, concurrent.futures.Future()))
        return held[-1][1]

    monkeypatch.setattr(compile_log, "in_background", in_background)
    direct.reset()
    cpu, tpu = _model(checkpoint, "cpu"), _model(checkpoint, "tpu")
    sentences = _sentences([3, 9, 5, 12, 20, 25, 17, 28])  # batches of 4, padded to 16 and 32 tokens
    expected = cpu.encode(sentences, batch_size=4)
    now, on_host = [0.0], []
    monkeypatch.setattr(direct, "_clock", lambda: now[0])

    def ten_seconds_on_host(*args, run=adapter._forward_on_the_host):
        now[0] += 10.0
        on_host.append(1)
        return run(*args)

    monkeypatch.setattr(adapter._traced_model_forward, "meanwhile", ten_seconds_on_host)
    monkeypatch.setattr(adapter._traced_model_forward, "trace_after", 15.0)
    first = tpu.encode(sentences, batch_size=4)
    weights = dict(adapter._host_weights[tpu])
    second = tpu.encode(sentences, batch_size=4)
    assert len(on_host) == 4 and not held and not direct._programs  # 10 s per bucket, then 20 s: nothing traced
    third = tpu.encode(sentences, batch_size=4)
    assert len(on_host) == 6 and len(held) == 2  # each bucket traced, its compile under way
    assert all(adapter._host_weights[tpu][name][2] is entry[2] for name, entry in weights.items())  # copied once
    for work, future in held:
        future.set_result(work())
    on_chip = tpu.encode(sentences, batch_size=4)
    assert len(on_host) == 6  # the device ran both batches
    for actual in (first, second, third, on_chip):
        torch.testing.assert_close(torch.from_numpy(actual), torch.from_numpy(expected), rtol=1e-5, atol=1e-5)


def test_weights_written_in_place_are_copied_to_the_host_again(checkpoint, monkeypatch):
    """A host copy serves until its weight changes: a weight written in place (its version moves) is copied
    again, and the host's embeddings follow it."""
    from hf_tpu import direct

    direct.reset()  # no program compiled before
    cpu, tpu = _model(checkpoint, "cpu"), _model(checkpoint, "tpu")
    sentences = _sentences([3, 9])
    monkeypatch.setattr(adapter._traced_model_forward, "trace_after", float("inf"))  # always on the host
    tpu.encode(sentences)
    first = next(iter(adapter._host_weights[tpu].values()))[2]
    with torch.no_grad():
        for model in (cpu, tpu):
            next(model.parameters()).mul_(2)
    torch.testing.assert_close(torch.from_numpy(tpu.encode(sentences)), torch.from_numpy(cpu.encode(sentences)),
                               rtol=1e-5, atol=1e-5)
    assert next(iter(adapter._host_weights[tpu].values()))[2] is not first and not direct._programs


@pytest.mark.parametrize("why", ["too large", "fails on the host"])
def test_a_model_the_host_should_not_run_waits_for_the_chip(checkpoint, monkeypatch, why):
    """A model over `HOST_MODEL_BYTES` (its host forward would outlast the chip's compile), or one whose forward
    fails on the host, is never copied there: its batches wait for the chip's compile, with the CPU's
    embeddings."""
    from hf_tpu import direct

    direct.reset()  # no program compiled before: the first batches ask the host
    if why == "too large":
        monkeypatch.setattr(adapter, "HOST_MODEL_BYTES", 1024)
    cpu, tpu = _model(checkpoint, "cpu"), _model(checkpoint, "tpu")
    if why != "too large":
        def fails(*args, **kwargs):
            raise RuntimeError("a tpu tensor outside the model's state")

        monkeypatch.setattr(torch.func, "functional_call", fails)
    sentences = _sentences([3, 9, 5])
    actual = tpu.encode(sentences)
    assert tpu not in adapter._host_weights and (tpu in adapter._not_on_the_host) == (why == "fails on the host")
    torch.testing.assert_close(torch.from_numpy(actual), torch.from_numpy(cpu.encode(sentences)), rtol=1e-5,
                               atol=1e-5)


def test_a_model_moved_from_the_cpu_keeps_its_cpu_weights_as_the_host_copy(checkpoint):
    """`.to("tpu")` of a small model keeps the CPU tensors it moved as the host path's copies: the first batch
    reads no weight back from the chip; a weight written on tpu afterwards is read back as before."""
    from hf_tpu import direct

    direct.reset()
    tpu = _model(checkpoint, "tpu")
    kept = dict(adapter._host_weights[tpu])
    assert set(kept) == set(adapter._state(tpu)) and all(entry[2].device.type == "cpu" for entry in kept.values())
    for name, (tensor, _, copy, _) in kept.items():
        assert torch.equal(copy, tensor.cpu())
    tpu.encode(_sentences([3, 9]))
    assert all(adapter._host_weights[tpu][name][2] is entry[2] for name, entry in kept.items())
    with torch.no_grad():
        next(tpu.parameters()).add_(1)
    tpu.encode(_sentences([3, 9]))
    name = next(iter(kept))
    assert adapter._host_weights[tpu][name][2] is not kept[name][2]


def test_a_kept_cpu_weight_written_through_another_reference_is_read_back(checkpoint):
    """A model whose parameters cannot be swapped (a weak reference to one) moves to tpu as new Parameters, and
    its caller may still hold the CPU ones the host copies alias: a copy written that way is not used."""
    import weakref

    from hf_tpu import direct

    direct.reset()
    model = _model(checkpoint, "cpu")
    cpu_weight = next(model.parameters())
    held = weakref.ref(cpu_weight)  # noqa: F841 - keeps `Module.to` from swapping the parameters
    model.to("tpu")
    name = next(iter(adapter._state(model)))
    assert next(model.parameters()) is not cpu_weight and adapter._host_weights[model][name][2].data_ptr() == \
        cpu_weight.data_ptr()
    expected = model.encode(_sentences([3, 9]))
    with torch.no_grad():
        cpu_weight.copy_(torch.randn_like(cpu_weight))  # not the model's weight any more
    torch.testing.assert_close(torch.from_numpy(model.encode(_sentences([3, 9]))), torch.from_numpy(expected))


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_host_runs_the_batch_without_its_bucket_padding(side):
    """The host path cuts the trailing columns no row attends to (the bucket's padding): it computes the
    tokenizer's batch, as the CPU does. Left padding, and a batch with an input the adapter does not pad, stay."""
    ids = torch.tensor([[2, 5, 6, 3], [2, 7, 3, 0]])
    features = {"input_ids": ids, "attention_mask": (ids != 0).long(), "token_type_ids": torch.zeros_like(ids)}
    padded = adapter.pad_to_bucket(features, 0, side, None)
    assert padded["input_ids"].shape == (2, 16)
    cut = adapter._without_bucket_padding(padded)
    if side == "right":
        assert all(torch.equal(cut[name], features[name]) for name in features)
    else:
        assert cut is padded
    other = {**padded, "pixel_values": torch.zeros(2, 3)}
    assert adapter._without_bucket_padding(other) is other
