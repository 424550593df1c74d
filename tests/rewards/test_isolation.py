"""Custom reward functions in worker processes: hangs, raises, sys.exit, aborts and wrong
signatures cost a row (counted), never the run; verl's batch / prime managers."""

import time

import numpy as np
import pytest

from hybridjax.rewards import RewardConfig, RewardFunctionError, RewardManager
from hybridjax.rewards.manager import overlong_enabled

USER_CODE = """
import os, sys, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "raise":
        raise ZeroDivisionError("boom")
    if solution_str == "exit":
        sys.exit(0)
    if solution_str == "abort":
        os.abort()
    return {"score": float(solution_str == ground_truth), "acc": 1.0}

def wrong_signature(solution_str):
    return 1.0

def always_fails(data_source, solution_str, ground_truth, extra_info=None):
    return undefined_name

def whole_batch(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    return [float(s == g) + bonus for s, g in zip(solution_strs, ground_truths)]
"""


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_rewards.py"
    path.write_text(USER_CODE)
    return str(path)


def _score(manager, responses, truths=None):
    n = len(responses)
    truths = truths or ["a"] * n
    return manager(responses, ["s"] * n, truths, None, np.ones(n, int), 1)


def test_hang_raise_exit_abort_cost_only_their_rows(user_file):
    config = RewardConfig(custom_path=user_file, num_workers=4, timeout_s=1.0)
    manager = RewardManager(config)
    assert manager.scorer.isolated
    start = time.perf_counter()
    result = _score(manager, ["a", "hang", "raise", "exit", "abort", "b", "a"])
    elapsed = time.perf_counter() - start
    np.testing.assert_array_equal(result.scores, [1, 0, 0, 0, 0, 0, 1])
    assert result.metrics["reward/num_timeouts"] == 1.0
    assert result.metrics["reward/num_errors"] == 3.0  # raise, sys.exit, os.abort
    assert elapsed < 10, elapsed  # the hanging call was stopped after timeout_s
    # The dead and the killed workers were replaced: the next batch scores normally.
    np.testing.assert_array_equal(_score(manager, ["a", "a", "b"]).scores, [1, 1, 0])
    manager.close()


def test_error_policy_raise_names_the_failure(user_file):
    manager = RewardManager(RewardConfig(custom_path=user_file, on_error="raise", timeout_s=1.0))
    with pytest.raises(RewardFunctionError, match=r"row 1 .*crash: worker process died"):
        _score(manager, ["a", "abort"])
    manager.close()


def test_wrong_signature_fails_at_once(user_file):
    with pytest.raises(TypeError, match=r"'wrong_signature' has signature \(solution_str\)"):
        RewardManager(RewardConfig(custom_path=user_file, custom_name="wrong_signature"))


def test_failing_on_every_row_of_the_first_batch_stops(user_file):
    manager = RewardManager(RewardConfig(custom_path=user_file, custom_name="always_fails"))
    with pytest.raises(RewardFunctionError, match=r"every row of the first batch.*NameError"):
        _score(manager, ["a", "b"])
    manager.close()
    # Later batches that fail on every row follow on_error (a bad step is not a bad function).
    manager = RewardManager(RewardConfig(custom_path=user_file))
    _score(manager, ["a"])
    assert _score(manager, ["raise", "raise"]).metrics["reward/num_errors"] == 2.0
    manager.close()


def test_batch_manager_calls_the_function_once_per_batch(user_file):
    config = RewardConfig(
        custom_path=user_file,
        custom_name="whole_batch",
        custom_kwargs=(("bonus", 0.5),),
        reward_manager="batch",
    )
    manager = RewardManager(config)
    np.testing.assert_array_equal(_score(manager, ["a", "b"]).scores, [1.5, 0.5])
    manager.close()
    with pytest.raises(ValueError, match="batch calls one function with the whole batch"):
        RewardManager(RewardConfig(reward_manager="batch"))
    with pytest.raises(TypeError, match="expected fn\\(data_sources"):
        RewardManager(RewardConfig(custom_path=user_file, reward_manager="batch"))


def test_prime_scores_builtins_in_processes_like_naive():
    rows = (
        ["#### 18", "18", "#### 7"],
        ["openai/gsm8k"] * 3,
        ["18", "18", "8"],
        None,
        [2, 1, 2],
        2,
    )
    naive, prime = (
        RewardManager(RewardConfig()),
        RewardManager(RewardConfig(reward_manager="prime")),
    )
    assert not naive.scorer.isolated and prime.scorer.isolated
    np.testing.assert_array_equal(naive(*rows).scores, prime(*rows).scores)
    np.testing.assert_array_equal(prime(*rows).scores, [1, 0, 0])
    naive.close(), prime.close()


def test_dapo_turns_on_the_overlong_shaping():
    assert overlong_enabled({"reward_manager": "dapo", "overlong_buffer": {"enable": False}})
    assert not overlong_enabled({"reward_manager": "naive", "overlong_buffer": {"enable": False}})
    assert overlong_enabled({"reward_manager": "naive", "overlong_buffer": {"enable": True}})
    with pytest.raises(ValueError, match=r"reward_model.reward_manager='verl'; expected one of"):
        RewardConfig(reward_manager="verl")


def test_os_exit_is_named_with_its_exit_code_at_once(tmp_path):
    """`os._exit(0)` mid-call looks to the process pool like a worker's normal exit: it was
    reported as a timeout after `timeout_s`; now the row fails at once, naming the code."""
    path = tmp_path / "exits.py"
    path.write_text(
        "import os\n\ndef compute_score(d, s, g, extra_info=None):\n    os._exit(int(s))\n"
    )
    manager = RewardManager(RewardConfig(custom_path=str(path), on_error="raise", timeout_s=30.0))
    for code in ("0", "3"):
        start = time.perf_counter()
        with pytest.raises(RewardFunctionError, match=rf"os\._exit\({code}\) \(exit code {code}\)"):
            _score(manager, [code])
        assert time.perf_counter() - start < 10
    manager.close()


def test_a_worker_started_after_its_pool_shut_down_leaves_quietly(capsys):
    """What such a worker meets while it unpickles its pool's lock: the semaphore is gone.
    The forkserver's hook drops that traceback and keeps every other one."""
    import importlib.util
    import multiprocessing.synchronize
    import sys

    from hybridjax.process_tree import PRELOAD, SCORING
    from hybridjax.rewards.scoring import quiet_bootstrap_errors

    lock = multiprocessing.synchronize.SemLock.__new__(multiprocessing.synchronize.SemLock)
    with pytest.raises(FileNotFoundError) as gone:
        lock.__setstate__((0, 1, 1, "/hybridjax-test-no-such-semaphore"))
    quiet_bootstrap_errors(gone.type, gone.value, gone.tb)
    assert capsys.readouterr().err == ""
    try:
        raise FileNotFoundError("a user's file")
    except FileNotFoundError:
        quiet_bootstrap_errors(*sys.exc_info())
    assert "Traceback" in capsys.readouterr().err
    for name in (PRELOAD, SCORING):  # the forkserver's preloads exist
        assert importlib.util.find_spec(name) is not None, name


DAEMON_CODE = """
import os, signal, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    path = extra_info
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # a daemon: fork, new session, fork again, the middle process leaves
        os.setsid()
        if os.fork() == 0:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
            os.write(writer, b"x")
            time.sleep(600)
        os._exit(0)
    os.waitpid(child, 0)
    os.read(reader, 1)  # the daemon has written its pid
    if solution_str == "die":
        os.kill(os.getpid(), signal.SIGKILL)  # the worker dies with its daemon alive
    return 1.0
"""


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(_alive, pids))


def test_daemons_a_reward_function_starts_do_not_outlive_the_pool(tmp_path):
    """A function that double-forks a `setsid` sleeper: the sleeper is gone once the pool is
    closed (it was reparented to init and ran on after the run, case K22 of issue 48)."""
    path = tmp_path / "daemon.py"
    path.write_text(DAEMON_CODE)
    manager = RewardManager(RewardConfig(custom_path=str(path), num_workers=2, timeout_s=20.0))
    pid_files = [str(tmp_path / f"pid{i}") for i in range(2)]
    result = manager(["a", "a"], ["s"] * 2, ["a"] * 2, pid_files, np.ones(2, int), 1)
    np.testing.assert_array_equal(result.scores, [1, 1])
    pids = [int(open(p).read()) for p in pid_files]
    assert all(map(_alive, pids))
    manager.close()
    assert _gone_within(pids, 5.0), [p for p in pids if _alive(p)]


def test_daemons_of_a_dead_worker_do_not_outlive_the_trainer(tmp_path):
    """A worker killed with its daemons alive (SIGKILL: no clean-up runs in it), then the
    trainer leaving without closing its pool: the daemons still go with the run."""
    import subprocess
    import sys

    (tmp_path / "daemon.py").write_text(DAEMON_CODE)
    pid_files = [str(tmp_path / f"pid{i}") for i in range(2)]
    script = (
        "import numpy as np, os, signal\n"
        "from hybridjax.rewards import RewardConfig, RewardManager\n"
        "if __name__ == '__main__':\n"
        f"    m = RewardManager(RewardConfig(custom_path={str(tmp_path / 'daemon.py')!r},"
        " num_workers=1, timeout_s=20.0))\n"
        f"    r = m(['a', 'die'], ['s'] * 2, ['a'] * 2, {pid_files!r}, np.ones(2, int), 1)\n"
        "    assert r.scores.tolist() == [1, 0], r\n"
    )
    with open(tmp_path / "log", "w") as log:  # not a pipe: a daemon would hold it open
        rc = subprocess.run([sys.executable, "-c", script], stdout=log, stderr=log, timeout=120)
    assert rc.returncode == 0, (tmp_path / "log").read_text()[-2000:]
    pids = [int(open(p).read()) for p in pid_files]
    assert _gone_within(pids, 5.0), f"daemons {pids} outlived the trainer"


def test_orphans_that_exit_are_reaped_by_their_worker(tmp_path):
    """A subreaper worker inherits the orphans of the function's processes: those that exit
    must not stay zombies (pids of the user's) until the worker stops."""
    path = tmp_path / "quick.py"
    path.write_text(
        "import os\n\ndef compute_score(d, s, g, extra_info=None):\n"
        "    if s == 'fork' and os.fork() == 0:\n        os.setsid()\n"
        "        if os.fork() == 0:\n            os._exit(0)\n        os._exit(0)\n"
        "    if s == 'fork':\n        os.wait()\n    return {'score': 0.0, 'pid': os.getpid()}\n"
    )
    manager = RewardManager(RewardConfig(custom_path=str(path), num_workers=1, timeout_s=20.0))
    worker = int(_score(manager, ["fork"] * 6).extra["pid"][0])
    time.sleep(0.5)  # the last orphan has exited
    _score(manager, ["a"])  # the call after reaps it
    with open(f"/proc/{worker}/task/{worker}/children") as f:
        children = f.read().split()
    manager.close()
    assert children == [], f"zombies under the worker: {children}"
