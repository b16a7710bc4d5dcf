"""Runs `pipeplan` CLI cases in-process, one JSON line in, one JSON line out, under a memory cap and a per-case
alarm, so that the fuzz test (the parent) sees tracebacks, hangs and runaway memory without risking its own process.

Input lines: {"argv": [...], "timeout": seconds}. Output lines (on the original stdout, prefixed with MARK):
{"exit": code, "traceback": bool, "timed_out": bool, "seconds": s, "output": last lines}.
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import time
import traceback

MARK = "@@fuzz@@"


class _Hang(BaseException):  # not an Exception: the CLI's one-line handler must not swallow it
    pass


def _alarm(signum, frame):
    raise _Hang()


def main() -> None:
    limit = int(sys.argv[1]) if len(sys.argv) > 1 else 6 << 30
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    from typer.testing import CliRunner

    from pipeplan.cli import app

    real_stdout = sys.stdout
    signal.signal(signal.SIGALRM, _alarm)
    runner = CliRunner()
    for line in sys.stdin:
        case = json.loads(line)
        start = time.monotonic()
        timed_out, tb, code, output = False, False, None, ""
        signal.alarm(int(case.get("timeout", 20)))
        try:
            result = runner.invoke(app, case["argv"], catch_exceptions=True)
            code, output = result.exit_code, result.output
            if result.exception is not None and not isinstance(result.exception, SystemExit):
                tb = True
                output += "".join(traceback.format_exception(result.exception))
        except _Hang:
            timed_out = True
        finally:
            signal.alarm(0)
        tb = tb or "Traceback (most recent call last)" in output
        report = {
            "exit": code,
            "traceback": tb,
            "timed_out": timed_out,
            "seconds": round(time.monotonic() - start, 3),
            "output": output.strip()[-4000:],
        }
        real_stdout.write(MARK + json.dumps(report) + "\n")
        real_stdout.flush()


if __name__ == "__main__":
    main()
