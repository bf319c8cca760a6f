"""`python -m pagoda.bench.alternate`: a benchmark run at a git revision and in this checkout in turn. Needs the
repository's git history (CI runs on a clone). Checks which tree each side imports and what is reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagoda.bench import alternate

KV_CALC = ["pagoda.entrypoints.cli", "kv-calc", "--kv-cache-memory", "64MiB", "--context-len", "128", "--json"]


def test_each_side_imports_its_own_tree() -> None:
    with alternate._worktree("HEAD") as root:
        where = Path(alternate._run(["-c", alternate._WHERE], root).strip().splitlines()[-1])
        assert where.resolve() == root.resolve()
        assert where.resolve() != alternate._PACKAGE_ROOT
        assert (root / "pagoda" / "layers" / "attention" / "cpp_kernel.cpp").is_file()
    assert not root.exists()  # the worktree is removed


def test_alternates_the_revision_with_the_checkout(capsys: pytest.CaptureFixture[str]) -> None:
    alternate.main(["--rev", "HEAD", "--rounds", "1", "--key", "num_blocks", "--", *KV_CALC])
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    runs, summary = lines[:-1], lines[-1]
    assert [(r["round"], r["side"]) for r in runs] == [(0, "HEAD"), (0, "checkout")]
    # 64 MiB over 16 tokens x 30 layers x 2 x 3 KV heads x 64 x 4 bytes a block
    assert all(r["output"]["num_blocks"] == 64 * 2**20 // (16 * 30 * 2 * 3 * 64 * 4) for r in runs)
    assert summary == {"key": "num_blocks", "rev": "HEAD", "rev_median": 91.0, "checkout_median": 91.0,
                       "checkout_over_rev": 1.0}


def test_bad_input_is_named() -> None:
    with pytest.raises(SystemExit, match="worktree add"):
        alternate.main(["--rev", "no-such-revision-anywhere", "--", *KV_CALC])
    with pytest.raises(SystemExit, match="no numeric field 'missing'"):
        alternate._field({"num_blocks": 91}, "missing", "HEAD")
    assert alternate._last_line("progress\n{\"a\": 1}\n") == {"a": 1}
    assert alternate._last_line("plain text\n") == "plain text"


def test_summary_gives_no_ratio_over_a_zero_median() -> None:
    assert alternate._summary("ms", "HEAD", {"HEAD": [2.0, 4.0, 9.0], "checkout": [1.0, 2.0, 3.0]}) == {
        "key": "ms", "rev": "HEAD", "rev_median": 4.0, "checkout_median": 2.0, "checkout_over_rev": 0.5}
    assert alternate._summary("ms", "HEAD", {"HEAD": [0.0], "checkout": [1.0]})["checkout_over_rev"] is None
