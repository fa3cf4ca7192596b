"""`hf_tpu.disk_cache`: a second process loads a traced call's program from HF_TPU_CACHE_DIR while the call traces,
and only where JAX's own key for the program is the one the first process named. (Processes of their own, started
in the default mode: not run once per eager mode as `tests/core` is.)"""

import concurrent.futures
import glob
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from tests.util import cpu_process_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# a traced call with state and a while_loop over it, in a fresh process: their results and the disk-cache counters
_PROGRAM = """
    import json, torch, hf_tpu
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16).requires_grad_(False).to("tpu")
    forward = hf_tpu.jit(lambda x: torch.tanh(layer(x)), state=(layer,))
    x = torch.randn(4, 16).to("tpu")
    hf_tpu.reset_metrics()
    y = forward(x)
    (z, n), = [hf_tpu.while_loop(lambda z, n: n < 3, lambda z, n: (layer(z), n + 1),
                                 (x, torch.zeros((), dtype=torch.long, device="tpu")), state=(layer,))]
    metrics = hf_tpu.metrics()
    print(json.dumps({"y": y.cpu().tolist(), "z": z.cpu().tolist(), "hits": metrics["disk_cache_hits"],
                      "prefetched": metrics["disk_cache_prefetched"]}))
"""


def _run(cache: str) -> dict:
    env = cpu_process_env(HF_TPU_NUM_DEVICES="1", HF_TPU_CACHE_DIR=cache)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_PROGRAM)], capture_output=True, text=True,
                            env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture
def filled(tmp_path):
    """A disk cache filled by a first process, and that process's results. (Its folder is part of JAX's keys: a
    copy elsewhere would be another cache.)"""
    cache = str(tmp_path / "cache")
    return cache, _run(cache)


def _entries(cache: str) -> list:
    return sorted(glob.glob(os.path.join(cache, "prefetch", "*.json")))


def test_a_second_process_loads_each_traced_program_while_it_traces(filled):
    cache, first = filled
    assert first["prefetched"] == 0
    assert len(_entries(cache)) == 2  # the call's program and the loop's
    second = _run(cache)
    assert second["prefetched"] == 2 and second["hits"] >= 2
    assert (second["y"], second["z"]) == (first["y"], first["z"])


@pytest.mark.parametrize("damage", ["another key", "not JSON"])
def test_an_entry_naming_another_program_or_unreadable_loads_nothing_ahead(filled, damage):
    """The key JAX computes decides: an entry that names another executable, or that cannot be read, costs the
    load ahead and nothing else: the program is read from the disk cache as without the entries, and the entry is
    written again."""
    cache, first = filled
    entries = _entries(cache)
    with open(entries[0]) as f:
        named = json.load(f)
    others = [json.load(open(path))["key"] for path in entries[1:]]
    with open(entries[0], "w") as f:
        f.write(json.dumps({**named, "key": others[0]}) if damage == "another key" else "{not json")
    second = _run(cache)
    assert second["prefetched"] == 1 and second["hits"] >= 2
    assert (second["y"], second["z"]) == (first["y"], first["z"])
    with open(entries[0]) as f:
        assert json.load(f) == named


def test_without_a_disk_cache_nothing_is_written_or_loaded_ahead(tmp_path, monkeypatch):
    import torch

    import hf_tpu
    from hf_tpu import disk_cache

    monkeypatch.setenv("HF_TPU_CACHE_DIR", "")
    layer = torch.nn.Linear(4, 4).to("tpu")
    hf_tpu.reset_metrics()
    hf_tpu.jit(lambda x: layer(x) * 3, state=(layer,))(torch.ones(2, 4).to("tpu"))
    assert hf_tpu.metrics()["disk_cache_prefetched"] == 0
    assert not disk_cache.enabled()


def test_a_first_call_runs_before_its_program_is_written_and_the_process_waits_for_the_write(tmp_path):
    """JAX's write of a program (serialise, compress, write: seconds for a large one) runs on a thread: the call
    that compiled the program returns first, and the process's exit waits for the write, so the next process finds
    the program."""
    code = """
        import json, time, jax, jax.numpy as jnp, hf_tpu
        from hf_tpu import disk_cache
        jax_write = disk_cache._jax_write
        def slow_write(cache_key, compile_time, module_name, *args):
            time.sleep(3 if module_name == "jit__lambda" else 0)
            jax_write(cache_key, compile_time, module_name, *args)
        disk_cache._jax_write = slow_write
        start = time.perf_counter()
        jax.block_until_ready(jax.jit(lambda x: jnp.tanh(x) * 3)(jnp.ones(8)))
        print(json.dumps({"first_call": time.perf_counter() - start}))
    """
    cache = tmp_path / "cache"
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                         env=cpu_process_env(HF_TPU_NUM_DEVICES="1", HF_TPU_CACHE_DIR=str(cache)), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["first_call"] < 2.5
    assert glob.glob(os.path.join(cache, "xla", "jit__lambda-*")), os.listdir(cache)


def test_a_keys_digest_is_the_same_in_another_process_and_tells_keys_apart():
    """Code by file, name and line; types by name; plain values by repr; an identity-keyed object by its type."""
    code = """
        import torch, hf_tpu
        from hf_tpu import disk_cache, trace_inputs
        def f(x):
            return x
        Thing = type("Thing", (), {})
        device = hf_tpu.platform.jax_device(0)
        keys = [(f.__code__, (torch.float32, (2, 3)), 1.0, ("object", Thing())), (f.__code__, (torch.float32, (2, 3)), 1, None),
                (f.__code__, (torch.bfloat16, (2, 3)), 1.0, None), (torch.nn.Linear, True, "a", torch.device("cpu"))]
        print(" ".join(disk_cache._digest(trace_inputs.key_text(key), device) for key in keys))
    """
    env = cpu_process_env(HF_TPU_CACHE_DIR="")
    runs = [subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=300) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr[-2000:]
    digests = [run.stdout.split() for run in runs]
    assert digests[0] == digests[1] and len(set(digests[0])) == 4


# the child reads Python state and exits: the deadlock JAX warns of needs JAX work in the child
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_a_forked_child_starts_its_own_loads():
    """A child forked while a load is pending has neither the parent's loader threads nor its pending loads: a load
    it waited for would never end."""
    from hf_tpu import disk_cache

    gate = threading.Event()
    with disk_cache._lock:
        if disk_cache._loader is None:
            disk_cache._loader = concurrent.futures.ThreadPoolExecutor(2)
        disk_cache._pending["parent's"] = ("key", 0, disk_cache._loader.submit(gate.wait))
    try:
        child = os.fork()
        if child == 0:  # the child: report through the exit status only
            os._exit(0 if disk_cache._loader is None and not disk_cache._pending and not disk_cache._lock.locked()
                     else 1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        gate.set()
        disk_cache._pending.pop("parent's", None)


def test_an_unusable_cache_dir_is_said_once_by_name_and_the_disk_cache_is_off(tmp_path):
    """A file (or a folder the process may not write) as HF_TPU_CACHE_DIR: one warning naming the variable and
    what to do, and a run without the disk cache, where JAX warned at each program that it could not read an
    entry and named no setting."""
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    code = ("import torch, hf_tpu; from hf_tpu import platform; x = torch.ones(3, device='tpu'); "
            "print(round((x + 1).sin().sum().item(), 4), torch.compile(lambda y: y * 2, backend='tpu')(x).sum().item(), "
            "repr(platform.cache_dir()))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env=cpu_process_env(HF_TPU_NUM_DEVICES="1", HF_TPU_CACHE_DIR=str(not_a_folder)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2.7279", "6.0", "''"], result.stdout
    assert result.stderr.count("HF_TPU_CACHE_DIR=") == 1, result.stderr
    assert "cannot hold the disk cache" in result.stderr and "set it empty" in result.stderr
    assert "Error reading" not in result.stderr and "Error writing" not in result.stderr, result.stderr
