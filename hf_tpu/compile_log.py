"""Word to the user while compiling takes long.

A program is compiled the first time it is met: for a model's forward on a TPU that takes tens of seconds,
in which nothing else happens. Every compile is watched (JAX reports the start and the phases of each one
it makes); one that runs longer than `HF_TPU_SLOW_COMPILE_SECONDS` (default 5; 0 turns this off) gets

- while it runs, once it has run that long, a line saying what is compiling;
- when it ends, a line naming it, its inputs, how long it took and where the time went (capture: Dynamo
  and AOT autograd turning Python into an ATen graph, or for `hf_tpu.jit` the Python trace, the function
  run on tracers; trace: running that graph, or the jaxpr the Python trace made, into a JAX program;
  lowering to XLA; the XLA compile itself, or its load from the disk cache).

Once a compile of one kind (a `torch.compile` graph) has taken that long in this process, the next of that
kind is announced as it starts. Compiles shorter than the threshold
(every single op's, in the common case) say nothing. The lines go to the `hf_tpu.compile` logger at
WARNING, where `HF_TPU_LOG_COMPILES` puts its lines, so that they show without any logging set up.

The one compile under way is `_current`: opened either by the code that knows what it compiles (`begin`,
`hf_tpu.compile` for a `torch.compile` graph, from the moment Dynamo starts), or by JAX's report that it
starts tracing a function; the XLA compile that follows closes it. A compile handed to a thread of its own
(`in_background`) leaves `_current` free for the next one: JAX's reports from that thread go to it.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import logging
import threading
import time

log = logging.getLogger("hf_tpu.compile")

# JAX's names of the phases of one compile, and ours
_PHASES = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowering",
    "/jax/core/compile/backend_compile_duration": "XLA",
}
_TRACE_STARTS = "/jax/core/compile/jaxpr_trace_duration"
_XLA_COMPILE = "/jax/core/compile/backend_compile_duration"
_DISK_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class Compile:
    """One compile under way."""

    what: str  # what compiles, as the user knows it
    kind: str | None  # compiles of one kind take alike long: once one was slow, the next is announced
    started: float  # time.perf_counter() when it began
    function: str  # the JAX function whose trace and XLA compile it is (its name, as JAX reports it)
    depth: int = 0  # JAX traces under way: a function traced inside another one is part of its trace
    captured: bool = False  # begun before JAX's trace (Dynamo and AOT autograd capture the graph first)
    capture: str = "capture"  # what ran before JAX's trace, as the log names it
    idle: bool = False  # between JAX's phases: a trace that nothing followed (`jax.eval_shape`) stays so
    inputs: str = ""  # the inputs' shapes and dtypes, once known
    phases: dict = dataclasses.field(default_factory=dict)  # phase name -> seconds
    from_disk: bool = False
    announced: bool = False

    def name(self) -> str:
        return f"{self.what}{f' for {self.inputs}' if self.inputs else ''}"


_lock = threading.Lock()
_wake = threading.Condition(_lock)
_current: list = [None]  # the Compile under way, or None
_elsewhere: dict = {}  # thread ident -> the Compile that thread runs in the background (`in_background`)
_background: set = set()  # the threads `in_background` started, until their work ends
_slow_kinds: dict = {}  # kind -> seconds the last slow compile of that kind took
_watcher: list = [None]


def threshold() -> float:
    from hf_tpu import settings

    return settings.get("HF_TPU_SLOW_COMPILE_SECONDS")


def begin(what: str, kind: str | None, function: str, started: float | None = None,
          captured: bool = False, capture: str = "capture") -> Compile:
    """Open the compile of `what`, which the XLA compile of the JAX function named `function` ends; `captured`
    when it began before JAX's trace, at `started` (the log names that part `capture`). A compile under way stays the one; one idle since its
    trace (a function only traced) is dropped."""
    limit = threshold()
    with _lock:
        if _current[0] is not None and not _current[0].idle:
            return _current[0]
        compile_ = _current[0] = Compile(what, kind, time.perf_counter() if started is None else started,
                                         function, captured=captured, capture=capture)
        announce = limit > 0 and kind is not None and kind in _slow_kinds
        last = _slow_kinds.get(kind)
        if announce:
            compile_.announced = True
        elif limit > 0:
            _start_watcher()
            _wake.notify()
    if announce:
        log.warning("hf_tpu: compiling %s (the last one like it took %.1fs) ...", compile_.name(), last)
    return compile_


def describe(what: str, kind: str, inputs_text) -> None:
    """Say what the compile under way compiles, from the code running in its trace: `inputs_text()` gives its
    inputs' text (called only when a compile is under way)."""
    compile_ = _current[0]
    if compile_ is not None:
        compile_.what, compile_.kind = what, kind
        if not compile_.inputs:
            compile_.inputs = inputs_text()


def in_background(work) -> concurrent.futures.Future:
    """Run `work()` (the XLA compile of the program just traced) on a thread of its own, with the compile under
    way: what JAX reports from that thread is its, and this thread may begin another compile meanwhile. The
    future holds what `work()` returned or raised."""
    future = concurrent.futures.Future()
    with _lock:
        compile_, _current[0] = _current[0], None

    def run():
        with _lock:
            if compile_ is not None:
                _elsewhere[threading.get_ident()] = compile_
                _wake.notify()  # the watcher looks at it too
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the compile
            future.set_exception(e)
        finally:
            with _lock:
                _elsewhere.pop(threading.get_ident(), None)

    thread = threading.Thread(target=run, name="hf_tpu background compile", daemon=True)
    _background.add(thread)
    future.add_done_callback(lambda _: _background.discard(thread))
    thread.start()
    return future



def compiling_in_background() -> bool:
    """Whether a compile started by `in_background` is still running (a program's compile beside the calls that a
    quicker form or another bucket serves meanwhile)."""
    return bool(_background)


@atexit.register
def _wait_for_background_compiles() -> None:
    """A process that ends while a compile runs on a thread of its own (a loop compiled ahead that the call never
    ran) waits for it: a daemon thread still inside XLA when the interpreter finalises can crash it."""
    for thread in list(_background):
        thread.join()


def _under_way() -> Compile | None:
    """The compile JAX's report from this thread belongs to."""
    return _elsewhere.get(threading.get_ident()) or _current[0]


def end(compile_: Compile | None = None, finished: bool = True) -> None:
    """Close the compile under way (`compile_`, when given, and only if it is still under way): log it if it
    `finished` slow (one that went no further than a trace is dropped)."""
    with _lock:
        elsewhere = next((ident for ident, c in _elsewhere.items() if c is compile_), None)
        if elsewhere is not None:
            done = _elsewhere.pop(elsewhere)
        else:
            done = _current[0]
            if done is None or (compile_ is not None and done is not compile_):
                return
            _current[0] = None
    seconds = time.perf_counter() - done.started
    limit = threshold()
    if not finished or limit <= 0 or seconds <= limit:
        return
    if done.kind is not None:
        _slow_kinds[done.kind] = seconds
    parts = dict(done.phases)
    accounted = sum(parts.values())
    if done.captured:  # what JAX does not time
        parts = {done.capture: max(seconds - accounted, 0.0), **parts}
    if done.from_disk and "XLA" in parts:
        parts["XLA (loaded from the disk cache)"] = parts.pop("XLA")
    log.warning("hf_tpu: compiled %s in %.1fs (%s)", done.name(), seconds,
                ", ".join(f"{phase} {value:.1f}s" for phase, value in parts.items()))


def _start_watcher() -> None:
    if _watcher[0] is None:
        _watcher[0] = threading.Thread(target=_watch, name="hf_tpu compile watcher", daemon=True)
        _watcher[0].start()


def _watch() -> None:
    """Say what is compiling once a compile has run longer than the threshold (at most once a compile)."""
    while True:
        with _lock:
            limit = threshold()
            waiting = [c for c in (_current[0], *_elsewhere.values())
                       if c is not None and not c.announced and not c.idle] if limit > 0 else []
            if not waiting:
                _wake.wait()
                continue
            compile_ = min(waiting, key=lambda c: c.started)
            left = compile_.started + limit - time.perf_counter()
            if left > 0:
                _wake.wait(left)
                continue
            compile_.announced = True
            name = compile_.name()
        log.warning("hf_tpu: compiling %s (%gs so far) ...", name, limit)


def _on_scalar(event: str, value, **kwargs) -> None:
    """JAX starts a phase of a compile; tracing a function starts a compile of its own unless one is under way."""
    if event not in _PHASES:
        return
    name = kwargs.get("fun_name", "a JAX function")
    compile_ = _under_way()
    if event != _TRACE_STARTS:
        if compile_ is not None and name == f"jit({compile_.function})":
            compile_.idle = False
        return
    if compile_ is not None and compile_.idle:
        # the function traced before went no further (its trace failed, or it was only traced): dropped
        end(compile_, finished=False)
        compile_ = None
    if compile_ is None:
        # of no kind: every op's program is a `<lambda>`, and one slow op says nothing of the next
        compile_ = begin(f"`{name}`", kind=None, function=name)
    compile_.depth += 1
    compile_.idle = False


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    phase = _PHASES.get(event)
    compile_ = _under_way()
    if phase is None or compile_ is None:
        return
    if phase == "trace":
        compile_.depth = max(compile_.depth - 1, 0)
    if kwargs.get("fun_name") not in (compile_.function, f"jit({compile_.function})"):
        return  # a function traced inside it (part of its trace), or another one compiled meanwhile
    compile_.phases[phase] = compile_.phases.get(phase, 0.0) + seconds
    if event == _XLA_COMPILE:
        end(compile_)
    elif compile_.depth == 0:
        compile_.idle = True  # until the next phase starts


def _on_event(event: str, **kwargs) -> None:
    compile_ = _under_way()
    if event == _DISK_CACHE_HIT and compile_ is not None:
        compile_.from_disk = True


def _listen_to_jax() -> None:
    from jax._src import monitoring

    monitoring.register_scalar_listener(_on_scalar)
    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


_listen_to_jax()
