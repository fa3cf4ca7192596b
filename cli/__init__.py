"""`hf-tpu`: the command line, one module a command. `hf-tpu env` describes the device; `hf-tpu demo` shows
it working; `hf-tpu compat` prints the per-architecture compatibility table; `hf-tpu sweep` checks
architectures.

It sits on top of the core and the Hugging Face adapters (shipped as `hf_tpu.cli` from the repository's
`cli/` folder); the core imports none of it."""

from __future__ import annotations

import argparse
import importlib
import os
import sys


def _model_folder(path: str) -> str:
    """`--model`'s check, before anything loads: a folder that exists and holds a Transformers config."""
    if not os.path.exists(path):
        raise argparse.ArgumentTypeError(f"{path} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise argparse.ArgumentTypeError(f"{path} is not a model folder (it has no config.json)")
    return path


def _model_types(text: str) -> list[str]:
    """`--only`'s check: comma-separated model types, at least one (an empty selection is not "all")."""
    model_types = [name.strip() for name in text.split(",") if name.strip()]
    if not model_types:
        raise argparse.ArgumentTypeError("names no model type (leave the option out to check every architecture)")
    return model_types


def _positive_integer(text: str) -> int:
    """`--limit`'s and `--jobs`' check: an integer of at least 1."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return number


def _positive_seconds(text: str) -> float:
    """`--timeout`'s check: a number of seconds above zero, finite."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = None
    if seconds is None or not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return seconds


def _run(command, args) -> int:
    """`command.run(args)`, ended quietly where the reader of its output goes away (`hf-tpu compat | head`): as
    Python's documentation says for SIGPIPE, stdout is pointed at devnull so that the interpreter's own flush
    at exit does not fail again, and the status is 1."""
    try:
        status = command.run(args)
        sys.stdout.flush()  # inside the try: a pipe closed while the last lines sat in the buffer
        return status
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-tpu", description="A native tpu device for PyTorch, backed by JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("env", help="print the platform, devices, versions and execution mode")
    demo_parser = sub.add_parser("demo", help="run the demo: tensors, a module and a causal LM on tpu against cpu")
    demo_parser.add_argument("--model", type=_model_folder, help="a local Transformers causal-LM checkpoint to use instead of a tiny Llama")
    compat_parser = sub.add_parser("compat", help="print the per-architecture compatibility table")
    compat_parser.add_argument("--markdown", action="store_true", help="print the table as the docs' markdown")
    compat_parser.add_argument("--write-docs", action="store_true",
                               help="regenerate the table section of docs/compatibility.md from the table "
                                    "(the checkout's, in an editable install; otherwise pass --docs)")
    compat_parser.add_argument("--docs", metavar="PATH",
                               help="the page to write instead of the repository's docs/compatibility.md")
    sweep_parser = sub.add_parser("sweep", help="run tiny models of every Transformers architecture on cpu and tpu")
    sweep_parser.add_argument("--only", type=_model_types, help="comma-separated model types, e.g. llama,mistral")
    sweep_parser.add_argument("--limit", type=_positive_integer, help="check only the first N architectures")
    sweep_parser.add_argument("--jobs", type=_positive_integer, default=1, help="worker processes (default 1)")
    sweep_parser.add_argument("--timeout", type=_positive_seconds, default=120.0,
                              help="seconds per architecture (default 120)")
    sweep_parser.add_argument("--write", action="store_true",
                              help="record the results in model_patches/table.json (the checkout's, in an "
                                   "editable install; otherwise pass --table)")
    sweep_parser.add_argument("--table", metavar="PATH",
                              help="the table file to update instead of the checkout's (implies --write)")
    sweep_parser.add_argument("--json", help="also write every result to this JSON file")
    args = parser.parse_args(argv)
    if args.command != "env":  # env lists a malformed variable with its error; the others refuse to run
        from hf_tpu import settings

        try:
            settings.validate()
        except ValueError as e:
            parser.exit(2, f"hf-tpu {args.command}: error: {e} (`hf-tpu env` lists every variable)\n")
        settings.tolerate_malformed(False)  # an adapter's variable, registered later, raises where it is read
    command = importlib.import_module(f".{args.command}", __name__)  # only the command's own imports
    return _run(command, args)
