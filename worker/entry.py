"""The ranks' entry: torchrun starts every rank as ``python -u -P -m worker.entry PROGRAM
ARGS`` (``-m MODULE ARGS`` for a recipe), which runs the program as ``__main__`` the way
``python -u PROGRAM ARGS`` would, then ends the process itself.

Why: with torch 2.14.1 a gloo worker thread may still be destroying a finished collective
when the interpreter finalizes; taking the GIL then ends that thread with pthread_exit, whose
unwinding through a noexcept destructor calls std::terminate ("terminate called without an
active exception", SIGABRT), in 1 to 2 runs of 10 of a correct 2-rank program
(tests/test_entry_rounds.py).
So once the program has finished (returned, ``sys.exit``, or an uncaught exception) this
does what the interpreter does before it finalizes, in its order: wait for the non-daemon
threads (``threading._shutdown``), run the ``atexit`` callbacks (``weakref.finalize`` among
them), flush every open stream; then it leaves with the program's status through
``os._exit``, skipping the finalization where the abort happens. A program that crashes by
itself still crashes: nothing here catches a signal.

What the program sees is what ``python -u PROGRAM`` gives it: ``sys.argv``, ``sys.path[0]``
(the program's directory, its links resolved; the working directory for ``-m``), a fresh
``__main__`` with ``__file__``, ``__loader__``, ``__spec__`` and ``__builtins__`` as CPython
sets them (``__file__`` and ``__cached__`` gone when the atexit callbacks run, unless it
ended by ``sys.exit``), the
exit status of ``sys.exit(n)`` and of an uncaught exception (1, after ``sys.excepthook``;
an uncaught KeyboardInterrupt ends it by SIGINT), signals at their defaults. An uncaught
exception is also written to torch's error file (TORCHELASTIC_ERROR_FILE, in the format of
torch's ``@record``, unless the program's own ``@record`` wrote it), which worker.tee reads
for the failure's reason. The documented differences: ``sys.orig_argv``, ``sys.flags.safe_path``
(``-P``: the job's directory, the working directory, must not stand in for this package;
subprocesses of ``multiprocessing`` inherit the flag, and are given ``sys.path`` anyway),
``sys.modules`` holding runpy and what it imports, and objects still alive at the end are
not torn down (no ``__del__`` runs: that teardown is what is skipped; their files' buffers
are flushed).

Once the program has finished with status 0 and its threads have ended, the rank's error file
says so (``FINISHED``): a rank torchrun then sees killed by a signal did its work, and
worker.tee counts it as a success.
"""

from __future__ import annotations

import builtins
import os
import sys
from types import ModuleType  # runpy has it imported already: not typing, which it has not

# The rank's error file (torch's record_exception writes it in this JSON shape) carries this
# message once the program has finished well: worker.tee reads it. ALONE: it finished, but
# in a world of several ranks it never joined a process group, so the ranks trained
# apart, each as if alone (accelerate on a CPU host without ACCELERATE_USE_CPU did).
FINISHED = "ddpq: the program finished"
ALONE = "ddpq: the program finished without joining a process group"
_joined: list[bool] = []  # set once the program calls init_process_group (_watch_joining)
SIGINT_STATUS = 130  # what CPython exits with when killing itself by SIGINT fails


def main() -> None:
    args = sys.argv[1:]
    # Held until os._exit: the module whose dict holds this module's globals.
    entry_module = sys.modules["__main__"]
    # The program must find its own ``worker`` package, if it has one, not ours: this
    # module keeps what it needs in its own globals.
    for name in [n for n in sys.modules if n == "worker" or n.startswith("worker.")]:
        del sys.modules[name]
    main_module = ModuleType("__main__")
    main_module.__dict__.update(__annotations__={}, __builtins__=builtins)
    sys.modules["__main__"] = main_module
    script = args[:1] != ["-m"]
    hidden = os.environ.get(HIDE_VAR, "")
    if hidden:
        _hide_distributions({_normal(n) for n in hidden.split(",") if n})
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        _watch_joining()
    status = _run(args, main_module, script)
    _leave(status, entry_module)


# Distributions of the worker's environment a job does not see installed unless it asks
# for them (worker.starting.venvs.hidden_distributions sets it): their import still works.
HIDE_VAR = "DDPQ_HIDE_DISTRIBUTIONS"


def _normal(name: str) -> str:
    """A distribution's name as importlib.metadata compares them (PEP 503, underscores)."""
    out = name.strip().lower()
    for ch in "-.":
        out = out.replace(ch, "_")
    while "__" in out:
        out = out.replace("__", "_")
    return out


def _hide_distributions(hidden: set[str]) -> None:
    """importlib.metadata finds none of ``hidden`` (the worker's rich: Lightning, seeing
    it installed, draws a Rich progress bar, which writes nothing to a log until the run
    ends). Only the metadata: a package that imports one of them still can."""
    for i, finder in enumerate(sys.meta_path):
        if hasattr(finder, "find_distributions") and not isinstance(finder, _Hiding):
            sys.meta_path[i] = _Hiding(finder, hidden)  # type: ignore[call-overload]


class _Hiding:
    """A meta path finder as it was, but for the distributions it no longer finds."""

    def __init__(self, inner: object, hidden: set[str]) -> None:
        self._inner = inner
        self._hidden = hidden

    def __getattr__(self, name: str) -> object:  # find_spec, invalidate_caches, ...
        return getattr(self._inner, name)

    def find_distributions(self, *args: object, **kwargs: object) -> object:
        context = args[0] if args else kwargs.get("context")
        wanted = getattr(context, "name", None)
        if isinstance(wanted, str) and _normal(wanted) in self._hidden:
            return iter(())
        found = self._inner.find_distributions(*args, **kwargs)  # type: ignore[attr-defined]
        if isinstance(wanted, str):
            return found
        return (d for d in found if _normal(getattr(d, "name", None) or "") not in self._hidden)


def _watch_joining() -> None:
    """Note when the program forms a process group (torch.distributed's
    init_process_group, however it is reached: DDP, Lightning, accelerate, a device mesh),
    so a rank of a world of several that never did can be said (ALONE). torch's
    distributed module is wrapped as it loads, or now if a warm launcher loaded it: the
    program sees the same function, called through."""
    name = "torch.distributed.distributed_c10d"
    loaded = sys.modules.get(name)
    if loaded is not None:
        _wrap(loaded)
        return
    # Not importlib.abc or .util: they import typing, which a program run bare has not.
    import importlib.machinery

    class Watch:
        def find_spec(
            self, fullname: str, path: object, target: object = None
        ) -> importlib.machinery.ModuleSpec | None:
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)  # type: ignore[arg-type]
            loader = getattr(spec, "loader", None)
            run = getattr(loader, "exec_module", None)
            if run is None:
                return spec

            def exec_module(module: ModuleType) -> None:
                run(module)
                _wrap(module)  # before torch.distributed's star import takes it

            loader.exec_module = exec_module  # type: ignore[union-attr]
            return spec

    sys.meta_path.insert(0, Watch())


def _wrap(c10d: ModuleType) -> None:
    real = getattr(c10d, "init_process_group", None)
    if real is None or getattr(real, "_ddpq_watched", False):
        return

    def init_process_group(*args: object, **kwargs: object) -> object:
        _joined.append(True)
        return real(*args, **kwargs)

    import functools

    watched = functools.wraps(real)(init_process_group)
    watched._ddpq_watched = True  # type: ignore[attr-defined]
    # Every module of torch's that took the function already (torch.distributed's star
    # import, a device mesh's), as a warm launcher's loaded them all: the same call,
    # watched. Only torch's: another package's lazy module may import on a getattr.
    torch_modules = [m for n, m in list(sys.modules.items()) if n.startswith("torch.")]
    for module in [c10d, *torch_modules]:
        if module is not None and getattr(module, "init_process_group", None) is real:
            setattr(module, "init_process_group", watched)  # noqa: B010 - any module


def _run(args: list[str], main_module: ModuleType, script: bool) -> int | None:
    """Run the program; its exit status (None: KeyboardInterrupt went uncaught)."""
    try:
        if script:
            _run_path(args, main_module)
        else:
            _run_module(args[1:])
    except SystemExit as exc:  # CPython exits from here, __file__ still set
        return _exit_status(exc)
    except BaseException as exc:
        _uncaught(exc)
        status = None if isinstance(exc, KeyboardInterrupt) else 1
    else:
        status = 0
    if script:  # CPython removes these once a file has run, before its atexit callbacks
        for name in ("__file__", "__cached__"):
            main_module.__dict__.pop(name, None)
    return status


def _run_module(args: list[str]) -> None:
    """``python -m MODULE ARGS``: runpy's own, which sets argv[0], __spec__ and the rest."""
    import runpy

    sys.argv[:] = ["-m", *args[1:]]  # as CPython hands it to runpy
    sys.path.insert(0, os.getcwd())
    runpy._run_module_as_main(args[0])  # type: ignore[attr-defined]


def _run_path(args: list[str], main_module: ModuleType) -> None:
    """``python PROGRAM ARGS``, as CPython's _PyRun_SimpleFileObject sets __main__ up."""
    from importlib.machinery import SourceFileLoader

    given = args[0]
    path = given if os.path.isabs(given) else os.path.join(os.getcwd(), given)
    sys.argv[:] = [given, *args[1:]]
    sys.path.insert(0, os.path.dirname(os.path.realpath(path)))
    namespace = main_module.__dict__
    namespace.update(
        __name__="__main__",
        __doc__=None,
        __package__=None,
        __loader__=SourceFileLoader("__main__", path),
        __spec__=None,
        __file__=path,
        __cached__=None,
    )
    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as exc:
        # CPython says so in one line and exits 2 (no class of our own: the entry raises
        # nothing a job could meet but what Python itself would).
        sys.stderr.write(
            f"{sys.executable}: can't open file {path!r}: [Errno {exc.errno}] {exc.strerror}\n"
        )
        raise SystemExit(2) from None
    exec(compile(source, path, "exec", dont_inherit=True), namespace)  # noqa: S102  the program


def _exit_status(exc: SystemExit) -> int:
    """The status CPython exits with for ``sys.exit(code)`` (_Py_HandleSystemExit)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code if -(2**63) <= code < 2**63 else -1
    sys.stderr.write(f"{code}\n")
    return 1


def _uncaught(exc: BaseException) -> None:
    """What CPython does with an exception nothing caught: sys.last_*, sys.excepthook
    (torch.distributed's prefixes the lines with the rank); and torch's error file."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # this module's frames: `python PROGRAM` has none
    exc.__traceback__ = tb
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException:
        sys.__excepthook__(type(exc), exc, tb)
    if isinstance(exc, Exception):  # what torch's @record records
        import traceback

        _error_file(_exception_line(exc), "".join(traceback.format_exception(exc)), keep=True)


def _exception_line(exc: BaseException) -> str:
    """The exception as the last line of its traceback names it (``ValueError: bad``,
    ``mypkg.errors.DataError: ...``): what worker.tee found in the output before."""
    kind = type(exc)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):
        name = f"{kind.__module__}.{name}"
    text = exc.msg if isinstance(exc, SyntaxError) else str(exc)
    return f"{name}: {text}" if text else name


def _error_file(message: str, callstack: str, keep: bool) -> None:
    """Write the rank's error file as torch's ErrorHandler.record_exception does (``keep``:
    not over one the program's own ``@record`` wrote)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or (keep and os.path.exists(path)):
        return
    import json
    import time

    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(time.time()))},
        }
    }
    # Whole or not at all: torchrun reads every failed rank's file, and a rank it stops
    # while it writes (rank 0 of a job whose rank 1 failed, its barrier broken) left an
    # empty one, which torchrun's JSON parse failed on, naming that the root cause.
    part = f"{path}.{os.getpid()}.part"
    try:
        with open(part, "w") as f:
            json.dump(data, f)
        os.replace(part, path)
    except OSError as exc:
        sys.stderr.write(f"[ddpq] could not write the error file {path}: {exc}\n")


def _leave(status: int | None, *keep: object) -> None:
    """The interpreter's shutdown up to its finalization (Py_FinalizeEx's order), then
    os._exit with the program's status."""
    threading = sys.modules.get("threading")
    if threading is not None:  # as wait_for_thread_shutdown: only if the program used it
        try:
            threading._shutdown()
        except BaseException as exc:
            sys.stderr.write(f"Exception ignored on threading shutdown: {exc!r}\n")
    if status == 0:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world > 1 and not _joined:
            rank = os.environ.get("RANK", "?")
            _error_file(f"{ALONE}: rank {rank} of a world of {world}", "", keep=False)
        else:
            _error_file(FINISHED, "", keep=False)
    import atexit

    atexit._run_exitfuncs()
    if not _flush_all() and status is not None:
        status = 120  # as CPython when sys.stdout or sys.stderr cannot be flushed at exit
    if status is None:  # an uncaught KeyboardInterrupt: end by SIGINT, as CPython does
        import signal

        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = SIGINT_STATUS
    os._exit(status & 0xFF)


def _flush_all() -> bool:
    """Flush every open stream, text ones before the binary ones under them, sys.stdout
    and sys.stderr last: what the skipped teardown would have written (a file the program
    left open included). Whether sys.stdout and sys.stderr flushed."""
    import contextlib
    import gc
    import io
    import warnings

    # By each object's real type, never isinstance: isinstance asks an object for its
    # __class__, and a weak proxy whose referent is gone (torch.compile leaves them in the
    # heap) raises ReferenceError there, which failed a program that had finished; others
    # warn when asked (torch.distributed.reduce_op says it is deprecated).
    def is_stream(o: object) -> bool:
        try:
            return issubclass(type(o), io.IOBase)
        except Exception:  # a metaclass of the program's that refuses: not a stream of ours
            return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        streams = [o for o in gc.get_objects() if is_stream(o)]
    streams.sort(key=lambda o: not isinstance(o, io.TextIOBase))
    for stream in streams:
        if stream is sys.stdout or stream is sys.stderr:
            continue
        try:
            if not stream.closed:
                stream.flush()
        except Exception:  # noqa: S112  what teardown does: a stream that fails is left
            continue
    flushed = True
    for std in (sys.stdout, sys.stderr):
        try:
            if std is not None and not getattr(std, "closed", False):
                std.flush()
        except Exception as exc:
            flushed = False
            if std is sys.stdout:
                with contextlib.suppress(Exception):
                    sys.stderr.write(f"Exception ignored on flushing sys.stdout:\n{exc!r}\n")
    return flushed


if __name__ == "__main__":
    main()
