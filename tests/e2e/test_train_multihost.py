"""`memfit train` on several hosts, and ranks that die or hang (CPU ranks, gloo, loopback).

Two torchrun agents on this machine stand for two hosts (`--nnodes 2 --nproc_per_node 1`), with
a static rendezvous (`--master_addr/--master_port`) or a c10d one (`--rdzv_endpoint`); they share
the run folder, as hosts with one shared file system do. A second mount namespace (`unshare -m`)
stands for a host that does not see the folder. Each result is compared with one process's run
of the same job (a tiny BERT classifier, dropout off, SGD, fp32). Every launch has a timeout:
a rank left waiting fails the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from memfit.errors import UsageError
from memfit.train.checkpoint import STATE_FILE
from memfit.train.peers import RankLostError, lost_contact, rank_timeout

WORDS = [f"w{i}" for i in range(60)]
LAUNCH_TIMEOUT = 150  # seconds for a whole run of two ranks (this machine is shared)
SURVIVOR_LIMIT = 60  # seconds for the other ranks to end after one is killed
ERROR = "memfit: error: "


def _write_data(path: Path, rows: int) -> Path:
    rng = random.Random(0)
    lines = ["text,label"]
    for _ in range(rows):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
        lines.append(f"{' '.join(words)},{int('w7' in words or 'w13' in words)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _env(root: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MEMFIT_CACHE_DIR=str(root / "memfit-cache"),
        HF_DATASETS_CACHE=str(root / "datasets-cache"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        **extra,
    )
    return env


def _args(model: str, data: Path, out: Path, *extra: str) -> list[str]:
    """40 steps of 8 rows (160 rows, 2 epochs), micro-batch 4 per rank."""
    return [
        "train", "--task", "classification", "--model", model, "--train-file", str(data),
        "--output-dir", str(out), "--effective-batch-size", "8", "--micro-batch-size", "4",
        "--optimizer", "sgd", "--lr", "0.5", "--seed", "3", "--device", "cpu", "--epochs", "2",
        *extra,
    ]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    topology: str, args: list[str], env: dict[str, str], *, node1_prefix: tuple[str, ...] = ()
) -> list[subprocess.Popen]:
    """The torchrun agents of one job: ``one-host`` (one agent, two ranks), ``static`` or ``c10d``
    (two agents, one rank each: two "hosts" on loopback)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    if topology == "one-host":
        commands = [[*torchrun, "--standalone", "--nproc_per_node", "2", "-m", "memfit", *args]]
    else:
        port = str(_free_port())
        if topology == "static":
            where = ["--master_addr", "127.0.0.1", "--master_port", port]
        else:
            where = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"]
        commands = [
            [*(node1_prefix if node else ()), *torchrun, "--nnodes", "2", "--nproc_per_node", "1",
             "--node_rank", str(node), *where, "-m", "memfit", *args]
            for node in (0, 1)
        ]  # fmt: skip
    return [
        subprocess.Popen(c, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]


def _finish(agents: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each agent's exit code and stderr (killed, with its ranks, past the timeout)."""
    results = []
    for agent in agents:
        try:
            _out, err = agent.communicate(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            for process in [*psutil.Process(agent.pid).children(recursive=True)]:
                process.kill()
            agent.kill()
            _out, err = agent.communicate()
            pytest.fail(f"a launch ran past {LAUNCH_TIMEOUT} s:\n{err[-3000:]}")
        results.append((agent.returncode, err))
    return results


def _ranks(agents: list[subprocess.Popen]) -> dict[int, psutil.Process]:
    """The rank processes the agents started, by global rank (their RANK)."""
    found: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + 30
    while len(found) < 2 and time.monotonic() < deadline:
        for agent in agents:
            for child in psutil.Process(agent.pid).children():
                with_rank = child.environ().get("RANK")
                if with_rank is not None:
                    found[int(with_rank)] = child
        time.sleep(0.05)
    assert len(found) == 2, found
    return found


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _losses(out: Path) -> list[float]:
    return [m["loss"] for m in _jsonl(out / "metrics.jsonl") if "loss" in m]


def _max_difference(a: Path, b: Path) -> float:
    wa = load_file(str(a / "model" / "model.safetensors"))
    wb = load_file(str(b / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def _no_memfit_traceback(stderr: str) -> None:
    """torchrun prints its own report of a failed rank; memfit's ranks print no traceback."""
    frames = [x for x in stderr.splitlines() if x.strip().startswith('File "')]
    assert not [x for x in frames if "memfit" in x], stderr[-3000:]
    assert "[rank0]:" not in stderr and "[rank1]:" not in stderr, stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tiny_classifier: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The job in one process."""
    root = tmp_path_factory.mktemp("multihost-reference")
    data = _write_data(root / "train.csv", 160)
    out = root / "one"
    run = subprocess.run(
        [sys.executable, "-m", "memfit", *_args(tiny_classifier, data, out)],
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return {"data": data, "out": out}


@pytest.mark.slow
def test_two_hosts_equal_one_process(tiny_classifier: str, reference: dict, tmp_path: Path) -> None:
    """--master_addr/--master_port (static rendezvous); the c10d rendezvous runs the kill -9 test
    below, whose resumed run must end with the same weights."""
    out = tmp_path / "run"
    results = _finish(
        _start("static", _args(tiny_classifier, reference["data"], out), _env(tmp_path))
    )
    for code, err in results:
        assert code == 0, err[-3000:]
    difference = _max_difference(reference["out"], out)
    print(f"2 hosts x 1 rank (static) vs one process: largest weight difference {difference:.2g}")
    assert difference <= 1e-5
    assert _losses(out) == pytest.approx(_losses(reference["out"]), abs=1e-5)
    assert len(_losses(out)) == 40
    # one run folder, written by global rank 0; both ranks' events in it
    assert json.loads((out / "run.json").read_text())["resolved"]["world_size"] == 2
    assert {e["rank"] for e in _jsonl(out / "events.jsonl")} == {0, 1}
    assert not list(out.glob(".memfit-ranks-*"))  # the shared-folder check leaves nothing
    # the progress and the summary come from global rank 0's host only
    assert sum("done: 40 steps" in err for _code, err in results) <= 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("topology", "victim", "sharding"),
    [
        ("one-host", 1, "none"),
        ("c10d", 0, "none"),
        pytest.param(
            "one-host",
            0,
            "zero3",
            marks=pytest.mark.skipif(
                importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed"
            ),
        ),
    ],
    ids=["1x2-kill-rank1", "2x1-c10d-kill-rank0", "1x2-zero3-kill-rank0"],
)
def test_kill_9_of_one_rank_ends_the_others_then_resume(
    tiny_classifier: str,
    reference: dict,
    tmp_path: Path,
    topology: str,
    victim: int,
    sharding: str,
) -> None:
    """kill -9 of one rank mid-run: the other ends within a minute with one line (exit 5) that
    names the newest checkpoint; the same command with --resume ends with the uninterrupted
    run's weights (under ZeRO-3 too: the survivor is inside DeepSpeed's gathers)."""
    out = tmp_path / "run"
    args = _args(tiny_classifier, reference["data"], out, "--save-every", "5")
    args += ["--sharding", sharding]
    env = _env(tmp_path)
    agents = _start(topology, args, env)
    ranks = _ranks(agents)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline and all(a.poll() is None for a in agents):
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 12:
            break
        time.sleep(0.02)
    ranks[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    survivor = ranks[1 - victim]
    while not _gone(survivor) and time.monotonic() - killed < SURVIVOR_LIMIT + 30:
        time.sleep(0.05)
    survivor_seconds = time.monotonic() - killed
    results = _finish(agents)
    agents_seconds = time.monotonic() - killed
    print(f"{topology}: rank {1 - victim} ended {survivor_seconds:.2f} s after kill -9 of rank "
          f"{victim}; every agent {agents_seconds:.2f} s")  # fmt: skip
    assert survivor_seconds < SURVIVOR_LIMIT
    stderr = "\n".join(err for _code, err in results)
    assert all(code != 0 for code, _err in results)
    lines = [x for x in stderr.splitlines() if x.startswith(ERROR)]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(f"{ERROR}rank {1 - victim} lost contact with another rank"), lines
    steps_done = len(_losses(out))
    assert 10 <= steps_done < 40  # killed mid-run: the resume below has work to do
    newest = max(int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*"))
    assert f"the newest checkpoint is {out / 'checkpoints' / f'step-{newest}'}" in lines[0]
    assert lines[0].endswith("run the same command again with --resume")
    if topology != "one-host":
        # the survivor's own agent reports its exit code (on one host the agent may stop it first)
        assert "exitcode: 5" in stderr
    _no_memfit_traceback(stderr)

    for code, err in _finish(_start(topology, [*args, "--resume"], env)):
        assert code == 0, err[-3000:]
    difference = _max_difference(reference["out"], out)
    print(f"{topology}: resumed vs one process: largest weight difference {difference:.2g}")
    assert difference <= 1e-5
    losses = _losses(out)
    assert len(losses) == 40  # the killed run's steps after its checkpoint were dropped, redone
    assert losses == pytest.approx(_losses(reference["out"]), abs=1e-5)
    resumes = [e for e in _jsonl(out / "events.jsonl") if e["type"] == "resume"]
    assert {e["step"] for e in resumes} == {newest}


@pytest.mark.slow
def test_a_rank_that_hangs_ends_the_others_after_memfit_rank_timeout(
    tiny_classifier: str, reference: dict, tmp_path: Path
) -> None:
    """A rank stopped (alive, sockets open: SIGSTOP) on one "host": the other waits
    MEMFIT_RANK_TIMEOUT, then ends with one line; once the stopped rank goes on, it ends too."""
    out = tmp_path / "run"
    args = _args(tiny_classifier, reference["data"], out, "--save-every", "5")
    agents = _start("static", args, _env(tmp_path, MEMFIT_RANK_TIMEOUT="3s"))
    ranks = _ranks(agents)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while time.monotonic() < deadline and all(a.poll() is None for a in agents):
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 6:
            break
        time.sleep(0.02)
    ranks[1].send_signal(signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        while not _gone(ranks[0]) and time.monotonic() - stopped < SURVIVOR_LIMIT:
            time.sleep(0.05)
        waited = time.monotonic() - stopped
    finally:
        ranks[1].send_signal(signal.SIGCONT)
    results = _finish(agents)
    print(f"rank 0 ended {waited:.2f} s after rank 1 stopped (MEMFIT_RANK_TIMEOUT=3s)")
    assert 3 <= waited < SURVIVOR_LIMIT
    stderr = "\n".join(err for _code, err in results)
    lines = [x for x in stderr.splitlines() if x.startswith(ERROR)]
    waited_line = [x for x in lines if x.startswith(f"{ERROR}rank 0 waited 3s for another rank")]
    assert len(waited_line) == 1, stderr[-3000:]
    assert "MEMFIT_RANK_TIMEOUT" in waited_line[0]
    # the stopped rank, let go, finds its own wait past the timeout (the time it was stopped
    # counts) or rank 0 gone: its own line, no traceback
    assert [x for x in lines if x.startswith(f"{ERROR}rank 1 ")], lines
    assert all(code != 0 for code, _err in results)
    _no_memfit_traceback(stderr)


def _can_unshare() -> bool:
    try:
        return (
            subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=10).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _can_unshare(), reason="needs unshare -m (a mount namespace)")
def test_a_run_folder_another_host_cannot_see_is_refused(
    tiny_classifier: str, reference: dict, tmp_path: Path
) -> None:
    """Host 1 (its own mount namespace, an empty file system over the run folder's parent) does
    not see host 0's folder: every rank stops before the first step; each host's first rank
    says why, once (each host has its own output)."""
    parent = tmp_path / "local-disk"
    parent.mkdir()
    out = parent / "run"
    args = _args(tiny_classifier, reference["data"], out)
    mount = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs tmpfs "{parent}" && exec "$0" "$@"']
    results = _finish(_start("static", args, _env(tmp_path), node1_prefix=tuple(mount)))
    expected = (
        f"{ERROR}--output-dir: {out} is rank 0's folder, but rank 1 ({socket.gethostname()}) "
        "cannot see it: on several hosts the run folder must be one shared folder (NFS or a "
        "cluster file system) at the same path on every host (rank 0 writes the checkpoints, "
        "every rank reads them back on --resume)"
    )
    for code, err in results:
        assert code != 0
        assert [x for x in err.splitlines() if x.startswith(ERROR)] == [expected], err[-3000:]
        assert "exitcode: 2" in err
    stderr = "\n".join(err for _code, err in results)
    assert not (out / "metrics.jsonl").exists()
    _no_memfit_traceback(stderr)


# --- the pieces, in this process --------------------------------------------------------------
def test_rank_timeout_reads_memfit_rank_timeout() -> None:
    assert rank_timeout({}) == datetime.timedelta(minutes=30)
    assert rank_timeout({"MEMFIT_RANK_TIMEOUT": "600"}) == datetime.timedelta(seconds=600)
    assert rank_timeout({"MEMFIT_RANK_TIMEOUT": "90s"}) == datetime.timedelta(seconds=90)
    assert rank_timeout({"MEMFIT_RANK_TIMEOUT": "10m"}) == datetime.timedelta(minutes=10)
    assert rank_timeout({"MEMFIT_RANK_TIMEOUT": "1.5h"}) == datetime.timedelta(minutes=90)
    for bad in ("soon", "0", "-5", "10 days"):
        with pytest.raises(UsageError, match=r"MEMFIT_RANK_TIMEOUT='.*': give how long"):
            rank_timeout({"MEMFIT_RANK_TIMEOUT": bad})


def test_lost_contact_tells_gloo_errors_from_others(tmp_path: Path) -> None:
    import torch.distributed as dist

    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
        "by peer [127.0.0.1]:9142. This is typically caused by a remote worker crashing."
    )
    assert lost_contact(RuntimeError(gloo), tmp_path) is None  # one process: no other ranks
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        (tmp_path / "checkpoints" / "step-5").mkdir(parents=True)
        (tmp_path / "checkpoints" / "step-5" / STATE_FILE).write_text("{}")
        lost = lost_contact(RuntimeError(gloo), tmp_path)
        assert isinstance(lost, RankLostError) and lost.exit_code == 5
        assert str(lost) == (
            "rank 0 lost contact with another rank (it died, was killed or failed: see its "
            "output): Connection closed by peer [127.0.0.1]:9142; the newest checkpoint is "
            f"{tmp_path / 'checkpoints' / 'step-5'}: run the same command again with --resume"
        )
        timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
                               "1800000ms for recv operation to complete")  # fmt: skip
        started = tmp_path / "started"
        started.mkdir()
        (started / "run.json").write_text("{}")
        silent = lost_contact(timeout, started)
        assert silent is not None and str(silent).startswith(
            "rank 0 waited 30m for another rank that did not answer"
        )
        # gloo's other words for it (a pending collective after the wait closed the connection)
        closed = lost_contact(RuntimeError("Application timeout caused pair closure"), started)
        assert closed is not None and str(closed).startswith(
            "rank 0 waited 30m for another rank that did not answer (stuck or too slow; "
            "MEMFIT_RANK_TIMEOUT sets the wait): Application timeout caused pair closure; "
        )
        assert "no checkpoint was written (--save-every N" in str(silent)
        # a rank that never joined: the run never began
        early = lost_contact(timeout, tmp_path / "none")
        assert early is not None and str(early).endswith(
            "; no step was run: run the same command again"
        )
        # a bug is not a lost rank: its traceback stays
        assert (
            lost_contact(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), tmp_path)
            is None
        )
        assert lost_contact(ValueError(gloo), tmp_path) is None
    finally:
        dist.destroy_process_group()
    assert torch.distributed.is_initialized() is False
