"""A library's own model tests on `cpu` and on `tpu`: which tests that pass on CPU also pass on tpu.

Each run is a pytest subprocess over the given test files of Transformers or Diffusers: once with the
library's test device set to `cpu`, once with it set to `tpu` and its test backend to `hf_tpu`
(`TRANSFORMERS_TEST_DEVICE`/`_BACKEND`, `DIFFUSERS_TEST_DEVICE`/`_BACKEND`: the library's testing_utils then
imports hf_tpu and seeds, synchronizes and empties caches through `torch.tpu` / `torch.accelerator`). The
tpu run simulates chips on the CPU platform as our own test suite does. Outcomes come from pytest's JUnit
XML; the figure is the share of CPU-passing tests that also pass on tpu, and the tpu-only failures are
grouped by their first error line.

Neither library ships its tests in its wheel: docs/conformance.md ("Transformers' own tests", "Diffusers'
own tests") says how to lay them out under /tmp/tf_tests and /tmp/diff_tests. Their extra dependency
(`parameterized`) goes on PYTHONPATH.

Run: python -m benchmarks.library_tests_on_tpu --library {transformers,diffusers} --tests PATH [PATH ...]
         [--jobs N] [-k EXPR] [--keep DIR] [--failures N]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

_SIMULATED_CHIPS = {"HF_TPU_PLATFORM": "cpu", "HF_TPU_NUM_DEVICES": "2"}


@dataclasses.dataclass(frozen=True)
class Library:
    """How a library's testing_utils is told which device to test: its environment variables per device."""

    name: str
    environment_prefix: str  # every variable the library's tests read starts with it; cleared before a run

    @property
    def device_environments(self) -> dict[str, dict[str, str]]:
        prefix = self.environment_prefix
        return {
            "cpu": {f"{prefix}DEVICE": "cpu"},
            "tpu": {f"{prefix}DEVICE": "tpu", f"{prefix}BACKEND": "hf_tpu", **_SIMULATED_CHIPS},
        }


LIBRARIES = {
    "transformers": Library("transformers", "TRANSFORMERS_TEST_"),
    "diffusers": Library("diffusers", "DIFFUSERS_TEST_"),
}


@dataclasses.dataclass(frozen=True)
class Outcome:
    status: str  # "passed", "failed", "error" or "skipped"
    message: str = ""


@dataclasses.dataclass
class Run:
    device: str
    outcomes: dict[str, Outcome]
    seconds: float


def run_pytest(tests: list[str], device: str, junit_path: Path, jobs: int = 1, keyword: str | None = None, *,
               library: Library) -> Run:
    """Runs `library`'s pytest tests `tests` for `device` in a subprocess and reads back every test's outcome.

    pytest-xdist runs the tests even with one job: a worker that crashes (a segfault in a lowering, say)
    is replaced and its test counted as failed, instead of losing the whole run.
    """
    environment = {key: value for key, value in os.environ.items() if not key.startswith(library.environment_prefix)}
    environment.update(library.device_environments[device])
    command = [sys.executable, "-m", "pytest", *tests, "-p", "no:cacheprovider", "-q", "-n", str(jobs),
               "--junitxml", str(junit_path), "-o", "junit_family=xunit1"]
    if keyword:
        command += ["-k", keyword]
    start = time.perf_counter()
    completed = subprocess.run(command, env=environment, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if not junit_path.exists():
        raise RuntimeError(f"pytest on {device} wrote no report (exit code {completed.returncode}):\n"
                           f"{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    return Run(device, read_outcomes(junit_path), seconds)


def read_outcomes(junit_path: Path) -> dict[str, Outcome]:
    """Test id ("module.Class::test") -> outcome, from a pytest JUnit XML report."""
    outcomes = {}
    for case in ElementTree.parse(junit_path).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcomes[test_id] = _outcome_of(case)
    return outcomes


def _outcome_of(case) -> Outcome:
    for status in ("failure", "error"):
        element = case.find(status)
        if element is not None:
            return Outcome("failed" if status == "failure" else "error", first_error_line(element))
    if case.find("skipped") is not None:
        return Outcome("skipped", case.find("skipped").get("message", ""))
    return Outcome("passed")


def first_error_line(element) -> str:
    """The exception line of a failure: pytest's message attribute, else the last `E   ` line of the text."""
    message = (element.get("message") or "").strip()
    if message:
        return message.splitlines()[0]
    error_lines = [line[1:].strip() for line in (element.text or "").splitlines() if line.startswith("E ")]
    return error_lines[0] if error_lines else "(no message)"


@dataclasses.dataclass
class Comparison:
    cpu_passed: list[str]
    tpu_passed: list[str]
    tpu_only_failures: dict[str, list[str]]  # first error line -> test ids

    @property
    def share(self) -> float:
        return len(self.tpu_passed) / len(self.cpu_passed) if self.cpu_passed else float("nan")


def compare(cpu: dict[str, Outcome], tpu: dict[str, Outcome]) -> Comparison:
    """Tests passing on CPU, those of them passing on tpu, and the rest grouped by their tpu error."""
    cpu_passed = sorted(test for test, outcome in cpu.items() if outcome.status == "passed")
    tpu_passed = [test for test in cpu_passed if tpu.get(test, Outcome("missing")).status == "passed"]
    failures = collections.defaultdict(list)
    for test in cpu_passed:
        outcome = tpu.get(test, Outcome("missing", "not run on tpu"))
        if outcome.status != "passed":
            failures[f"[{outcome.status}] {outcome.message}"].append(test)
    ordered = dict(sorted(failures.items(), key=lambda item: -len(item[1])))
    return Comparison(cpu_passed, tpu_passed, ordered)


def report(comparison: Comparison, runs: list[Run], failures_shown: int = 3) -> str:
    lines = [f"{run.device}: {sum(o.status == 'passed' for o in run.outcomes.values())} passed, "
             f"{sum(o.status in ('failed', 'error') for o in run.outcomes.values())} failed, "
             f"{sum(o.status == 'skipped' for o in run.outcomes.values())} skipped of {len(run.outcomes)} "
             f"in {run.seconds:.0f} s" for run in runs]
    lines.append(f"passing on cpu: {len(comparison.cpu_passed)}; of those passing on tpu: "
                 f"{len(comparison.tpu_passed)} ({100 * comparison.share:.1f}%)")
    if comparison.tpu_only_failures:
        lines.append("tpu-only failures by first error line:")
    for message, tests in comparison.tpu_only_failures.items():
        lines.append(f"  {len(tests):4d}  {message[:200]}")
        lines += [f"          {test}" for test in tests[:failures_shown]]
        if len(tests) > failures_shown:
            lines.append(f"          ... and {len(tests) - failures_shown} more")
    return "\n".join(lines)


def main(argv=None, library: Library | None = None) -> None:
    """Command line; `library` fixed by a per-library entry point, else chosen with `--library`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if library is None:
        parser.add_argument("--library", choices=sorted(LIBRARIES), required=True, help="whose tests these are")
    parser.add_argument("--tests", nargs="+", required=True, help="the library's test files or directories")
    parser.add_argument("--jobs", type=int, default=1, help="pytest-xdist workers per run")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression, e.g. to drop tests taking minutes")
    parser.add_argument("--keep", type=Path, help="directory to keep the JUnit reports in")
    parser.add_argument("--failures", type=int, default=3, help="test ids listed per failure group")
    args = parser.parse_args(argv)
    library = library or LIBRARIES[args.library]

    with tempfile.TemporaryDirectory() as scratch:
        reports = args.keep or Path(scratch)
        reports.mkdir(parents=True, exist_ok=True)
        runs = [run_pytest(args.tests, device, reports / f"{device}.xml", args.jobs, args.keyword, library=library)
                for device in ("cpu", "tpu")]
    print(report(compare(runs[0].outcomes, runs[1].outcomes), runs, args.failures))


if __name__ == "__main__":
    main()
