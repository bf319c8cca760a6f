"""Run a benchmark at a git revision and in this checkout in turn, so that both see the same machine: these machines'
speed drifts by up to 1.7x from one hour to the next, and the kernel benchmarks' `--versus-rev` covers one kernel,
not a whole engine step.

    python -m pagoda.bench.alternate --rev HEAD --rounds 3 --key decode_step_ms -- \\
        pagoda.bench.decode_step --num-seqs 1 --attention-backend cpp --quantization q4_1 --rounds 5 --steps 20

Each round runs `python -m MODULE ARGS` once at REV (checked out into a temporary git worktree, removed at the end)
and once in this checkout, each in a fresh process whose working directory is that tree's root. `python -m` puts
the working directory first on sys.path, ahead of the editable install, so `import pagoda` takes that tree's
package, C++ kernel sources included (the tool checks where each side imports it from before the first round).
Prints one JSON line per run, {"round", "side", "output"} (output: the run's last line of stdout, parsed where it
is JSON), then, with --key, the medians of that field on each side and checkout_over_rev, the checkout's median
over REV's (for a time such as decode_step_ms, below 1 means the checkout is faster; null where REV's median is 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the checkout this module runs from
_WHERE = "import pathlib, pagoda; print(pathlib.Path(pagoda.__file__).resolve().parents[1])"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", required=True, help="the git revision to compare this checkout with")
    p.add_argument("--rounds", type=int, default=3, help="runs of each side, alternated (default 3)")
    p.add_argument("--key", default=None, help="a numeric field of the module's JSON output to summarize")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- MODULE [ARGS...]")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("name the benchmark to run after --, e.g. -- pagoda.bench.decode_step --num-seqs 1")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    with _worktree(args.rev) as rev_root:
        sides = {args.rev: rev_root, "checkout": _PACKAGE_ROOT}
        for side, root in sides.items():
            where = _run(["-c", _WHERE], root).strip().splitlines()[-1]
            if Path(where).resolve() != root.resolve():
                raise SystemExit(f"{side}: pagoda was imported from {where}, not from {root}")
        values: dict[str, list[float]] = {side: [] for side in sides}
        for i in range(args.rounds):
            for side, root in sides.items():
                output = _last_line(_run(["-m", *command], root))
                print(json.dumps({"round": i, "side": side, "output": output}), flush=True)
                if args.key is not None:
                    values[side].append(_field(output, args.key, side))
    if args.key is not None:
        print(json.dumps(_summary(args.key, args.rev, values)))


def _summary(key: str, rev: str, values: dict[str, list[float]]) -> dict[str, Any]:
    """The medians of key on each side and checkout_over_rev; null where REV's median is 0 (no ratio to give)."""
    medians = {side: statistics.median(v) for side, v in values.items()}
    ratio = round(medians["checkout"] / medians[rev], 3) if medians[rev] != 0 else None
    return {"key": key, "rev": rev, "rev_median": medians[rev], "checkout_median": medians["checkout"],
            "checkout_over_rev": ratio}


@contextmanager
def _worktree(rev: str) -> Iterator[Path]:
    """A detached git worktree of this checkout's repository at rev, removed on exit."""
    with tempfile.TemporaryDirectory(prefix="pagoda-rev-") as tmp:
        root = Path(tmp) / "tree"
        _git("worktree", "add", "--detach", str(root), rev)
        try:
            yield root
        finally:
            _git("worktree", "remove", "--force", str(root))


def _git(*args: str) -> None:
    done = subprocess.run(["git", *args], cwd=_PACKAGE_ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"git {' '.join(args)} failed (a git checkout of the repository is needed): "
                         f"{done.stderr.strip()}")


def _run(python_args: list[str], root: Path) -> str:
    done = subprocess.run([sys.executable, *python_args], cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-20:])
        raise SystemExit(f"python {' '.join(python_args)} in {root} exited with {done.returncode}:\n{tail}")
    return done.stdout


def _last_line(stdout: str) -> Any:
    lines = stdout.strip().splitlines()
    if not lines:
        return None
    try:
        return json.loads(lines[-1])
    except json.JSONDecodeError:
        return lines[-1]


def _field(output: Any, key: str, side: str) -> float:
    value = output.get(key) if isinstance(output, dict) else None
    if not isinstance(value, (int, float)):
        raise SystemExit(f"{side}: the output has no numeric field {key!r}: {output!r}")
    return float(value)


if __name__ == "__main__":
    main()
