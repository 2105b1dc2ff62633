"""Runs the tests' engine scripts (a parser built and fed argvs, the flag table generator)
inside an engine's env, one after another in this one interpreter.

Each script is what `python -c SCRIPT ARGV…` (or `python PATH`) would run, with the same stdin
and argv; the reply is what it printed. The engine's imports (vLLM's take 10-20 s) are paid
once per test session, not once per script. Requests and replies, one JSON line each:
  run: script (source) or path, stdin, argv -> stdout
A script that raises, or exits non-zero, is an `error` reply with its traceback.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import traceback
from typing import Any


def run(req: dict[str, Any]) -> dict[str, Any]:
    out = io.StringIO()
    saved = sys.stdin, sys.argv, sys.path[0]
    path = req.get("path")
    sys.stdin = io.StringIO(req.get("stdin", ""))
    sys.argv = [path or "-c", *req.get("argv", [])]
    sys.path[0] = os.path.dirname(path) if path is not None else ""  # as `python PATH` / `-c`
    try:
        with contextlib.redirect_stdout(out):
            if path is not None:
                runpy.run_path(path, run_name="__main__")
            else:
                exec(compile(req["script"], "<script>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        if e.code not in (None, 0):
            return {"error": f"exit {e.code}\n{traceback.format_exc()}"}
    except BaseException:
        return {"error": traceback.format_exc()}
    finally:
        sys.stdin, sys.argv, sys.path[0] = saved
    return {"stdout": out.getvalue()}


def main() -> None:
    # Replies go to the original stdout alone: whatever else writes to fd 1 (an engine's log
    # handler bound to it) lands on stderr and cannot garble a reply.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    print(json.dumps({"ready": True}), file=replies, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        reply = run(req) if req.get("op") == "run" else {"error": f"unknown op {req.get('op')}"}
        print(json.dumps(reply), file=replies, flush=True)


if __name__ == "__main__":
    main()
