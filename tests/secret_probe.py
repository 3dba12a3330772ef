"""A hostile job: look everywhere a program running as the worker's user can look for
the worker's secrets, and print all it could read (tests/test_job_secrets.py then
checks that no secret is in the job's log). Not a test module: the worker runs it."""

import json
import os
import sys
from pathlib import Path

found: list[str] = []
report: dict[str, object] = {"environ_denied": [], "environ_read": [], "files_read": 0}

found += [f"{k}={v}" for k, v in os.environ.items()]
for entry in Path("/proc").iterdir():
    if not entry.name.isdigit() or int(entry.name) == os.getpid():
        continue
    try:
        cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        continue
    for what in ("environ", "mem"):
        try:
            with open(entry / what, "rb") as f:
                data = f.read(1 << 20)
            found.append(data.decode(errors="replace"))
            if what == "environ":
                report["environ_read"].append(cmdline)  # type: ignore[union-attr]
        except OSError:
            if what == "environ":
                report["environ_denied"].append(cmdline)  # type: ignore[union-attr]
for root in sys.argv[1:]:  # the worker's directories, if they are reachable
    for path in Path(root).rglob("*"):
        try:
            if path.is_file():
                found.append(path.read_text(errors="replace"))
                report["files_read"] += 1  # type: ignore[operator]
        except OSError:
            pass
print("PROBE " + json.dumps(report), flush=True)
for text in found:
    print(text, flush=True)
