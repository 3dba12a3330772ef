"""Drop ddpq's own entry from a lock pip-compile wrote: `ddpq[all]` names ddpq's own extras,
so pip-compile pins `ddpq @ file:///...` (a path of the machine it ran on, with no hash),
which make venv and the images install from the checkout instead."""

from __future__ import annotations

import re
import sys

for name in sys.argv[1:]:
    with open(name) as f:
        text = f.read()
    # the entry, its "# via" lines, and pip-compile's warning about its missing hash
    text = re.sub(r"# WARNING: pip install will require.*?\n(?=\S)(?!#)", "", text, flags=re.S)
    text = re.sub(r"^ddpq @ .*\n(    #.*\n)*", "", text, flags=re.M)
    with open(name, "w") as f:
        f.write(text)
