"""One page's Python interpreter: runs its `python` blocks in order in one namespace, as Sybil does.

Started by tests/docs/session.py as `python pydriver.py REPLY_FD`. Each block comes on stdin as one JSON
line {"code", "filename"}; the answer goes to REPLY_FD as one JSON line {"exit", "error"}: exit 0, the
code of a SystemExit, or 1 with the traceback in "error". What the block prints goes to this process's
stdout and stderr, which the session points at a file (so does every process the block starts).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any


def run(code: str, filename: str, namespace: dict[str, Any]) -> dict[str, Any]:
    try:
        exec(compile(code, filename, "exec"), namespace)  # the page's own example, as a reader would run it
    except SystemExit as exc:
        code_ = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return {"exit": code_, "error": "" if code_ == 0 else f"SystemExit({exc.code!r})"}
    except BaseException:  # noqa: BLE001 - any failure of the example is its result, reported to the runner
        return {"exit": 1, "error": traceback.format_exc()}
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return {"exit": 0, "error": ""}


def main() -> None:
    reply = os.fdopen(int(sys.argv[1]), "w")
    # The real __main__'s namespace, as `python page.py` would have: what a block defines pickles by reference.
    namespace = vars(sys.modules["__main__"])
    for line in sys.stdin:
        request = json.loads(line)
        reply.write(json.dumps(run(request["code"], request["filename"], namespace)) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
