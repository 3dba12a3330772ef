"""A program that records what it sees of how it was started, as JSON into the file its
first argument names (tests/test_entry.py runs it bare and through worker.entry, and
compares). Not a test module: it is run as a script or with -m."""

import atexit
import json
import os
import signal
import sys
import threading

main = sys.modules["__main__"]


def _loader(loader: object) -> object:
    return None if loader is None else [type(loader).__name__, getattr(loader, "name", None),
                                        getattr(loader, "path", None)]  # fmt: skip


def _spec(spec: object) -> object:
    if spec is None:
        return None
    return {
        k: getattr(spec, k)
        for k in (
            "name",
            "origin",
            "parent",
            "cached",
            "has_location",
            "submodule_search_locations",
        )
    } | {"loader": _loader(getattr(spec, "loader", None))}


flags = {k: getattr(sys.flags, k) for k in dir(sys.flags) if not k.startswith(("_", "n_"))}
flags.pop("safe_path")  # worker.entry's documented difference (-P)
flags.pop("count", None)
flags.pop("index", None)
record = {
    "environ": dict(os.environ),
    "argv": sys.argv,
    "cwd": os.getcwd(),
    "path": sys.path,
    "executable": sys.executable,
    "flags": flags,
    "name": __name__,
    "main_is_this": main.__dict__ is globals(),
    "main_keys": sorted(k for k in main.__dict__ if k.startswith("__")),
    "file": main.__dict__.get("__file__"),
    "cached": main.__dict__.get("__cached__", "absent"),
    "package": main.__dict__.get("__package__"),
    "doc": main.__doc__ is not None,
    "spec": _spec(main.__dict__.get("__spec__")),
    "loader": _loader(main.__dict__.get("__loader__")),
    "builtins": type(main.__dict__.get("__builtins__")).__name__,
    "annotations": main.__dict__.get("__annotations__"),  # noqa: RUF063  the key itself
    "code_file": _loader.__code__.co_filename,
    "signals": {
        s.name: repr(signal.getsignal(s)) for s in signal.valid_signals() if hasattr(s, "name")
    },
    "stdout": [sys.stdout.line_buffering, sys.stdout.write_through, sys.stdout.encoding],
    "stderr": [sys.stderr.line_buffering, sys.stderr.write_through, sys.stderr.encoding],
    "threads": [t.name for t in threading.enumerate()],
    "worker_module": "worker" in sys.modules,  # a job's own package named worker must win
}


def _at_exit() -> None:
    record["at_exit_file"] = "__file__" in main.__dict__
    with open(sys.argv[1], "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)


atexit.register(_at_exit)
