"""Rank processes forked from the fork server (`autopar.runtime.pool.rank_context`): each takes
the environment of its start, not the server's, and a script rank reports its exit code and
stderr as the interpreter would."""

from __future__ import annotations

import os

from autopar.runtime.pool import WorkerPool, rank_context
from autopar.tools.testing import run_rank_scripts

VAR = "AUTOPAR_TEST_POOL_ENV"


def _read(rank: int, groups: dict) -> tuple[str | None, str]:
    return os.environ.get(VAR), os.environ.get("OMP_NUM_THREADS", "")


def test_a_worker_sees_the_environment_of_its_start_not_the_servers(monkeypatch):
    first = WorkerPool(2)  # the fork server runs from here on, without VAR
    first.close()
    assert VAR not in os.environ
    monkeypatch.setenv(VAR, "set after the server started")
    pool = WorkerPool(2)
    try:
        seen = pool.run(_read, (("tp", 2),), [()] * 2)
    finally:
        pool.close()
    assert seen == [("set after the server started", "1")] * 2
    assert rank_context().get_start_method() == "forkserver"


def test_a_script_rank_exits_with_its_code_and_its_stderr(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(
        "import os, sys\n"
        "rank, port, word = sys.argv[1:]\n"
        "print('to stdout')\n"
        "print(f'rank {rank} {word} {os.environ[\"OMP_NUM_THREADS\"]}', file=sys.stderr)\n"
        "if rank == '1':\n"
        "    raise SystemExit(7)\n"
        "if rank == '2':\n"
        "    raise ValueError('bad rank')\n"
    )
    codes, errs = run_rank_scripts(str(script), 3, "hello", timeout=60)
    assert codes == [0, 7, 1]
    assert [e.splitlines()[0] for e in errs] == [f"rank {r} hello 1" for r in range(3)]
    assert "ValueError: bad rank" in errs[2] and "to stdout" not in "".join(errs)


def test_a_script_rank_that_outlives_the_timeout_is_killed(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    codes, _ = run_rank_scripts(str(script), 2, timeout=1)
    assert codes == [-9, -9]


def test_without_a_fork_server_ranks_are_spawned(monkeypatch):
    import torch.multiprocessing as mp

    monkeypatch.setattr(mp, "get_all_start_methods", lambda: ["spawn"])  # Windows
    assert rank_context().get_start_method() == "spawn"
