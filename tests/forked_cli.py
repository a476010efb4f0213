"""Run many ``python -m <module> <argv>`` invocations from one interpreter that imported the
modules once: each invocation is a forked child that calls ``<module>.main(argv)`` with its
own environment, stdout and stderr, and exits with what ``main`` returned, as
``sys.exit(main())`` under ``__main__`` does.

Why: a bad-input check must run the real command in a process of its own (its exit code,
its one line on stderr, no Ray started), but 21 fresh interpreters that each import torch
cost half a minute of the 2-core suite; a fork costs a few milliseconds. The parent never
touches Ray, so every child starts from the state a fresh ``python -m`` would reach after
its imports.

Usage (what tests/test_config.py does): write a JSON list of cases to stdin, each
``{"id", "module", "argv", "env", "cwd"}``, and read one JSON object from stdout,
``{id: {"code", "stdout", "stderr"}}``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import tempfile
import time

TIMEOUT_S = 240  # per invocation; a child still running then is killed (exit -9)


def _child(module: str, argv: list[str], env: dict[str, str], cwd: str, out: int, err: int) -> None:
    code = 1
    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [module, *argv]
        try:
            code = importlib.import_module(module).main(argv)
        except SystemExit as exit_:  # as the interpreter handles it: a message goes to stderr
            if exit_.code is not None and not isinstance(exit_.code, int):
                print(exit_.code, file=sys.stderr)
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except BaseException:  # noqa: BLE001 - what the interpreter would print, then exit 1
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if code is None else code)


def main() -> int:
    cases = json.load(sys.stdin)
    for module in sorted({case["module"] for case in cases}):
        importlib.import_module(module)  # once, in the parent: the children share it
    results = {}
    with tempfile.TemporaryDirectory(prefix="forked-cli-") as tmp:
        for case in cases:
            paths = [os.path.join(tmp, f"{len(results)}.{stream}") for stream in ("out", "err")]
            out, err = (os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for p in paths)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(case["module"], case["argv"], case["env"], case["cwd"], out, err)
            os.close(out)
            os.close(err)
            deadline = time.monotonic() + TIMEOUT_S
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    _, status = os.waitpid(pid, 0)
                    break
                time.sleep(0.01)
            stdout, stderr = (open(p, encoding="utf-8", errors="replace").read() for p in paths)
            results[case["id"]] = {"code": os.waitstatus_to_exitcode(status), "stdout": stdout, "stderr": stderr}
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
