"""Multi-process runs on localhost: real Python processes joined by `jax.distributed`
(CPU devices, gloo collectives), each with 2 devices.

One run of two processes (tests/_multiprocess_worker.py) checks, in order:
SP on a tp=4 ring across the processes and CFG-parallel (cfg=2 x tp=2, one cfg
group per process) against the one-process result and diffusers' fixture;
that each process read only the slices of its own devices; two CFG denoise
steps equal on every process and to one process; a whole WanPipeline call (SP across the
processes) equal on both and to diffusers' frames, and with the step cache the same decisions on
both; the bench reporting once;
then process 1 dies and process 0 must stop with a clear error, fast. Two
one-process runs check that a coordinator that never answers and a peer that
never joins end in bounded time. Every subprocess has a timeout; ports are
taken from the OS (bind to port 0), so parallel runs cannot collide.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from difflet_tpu.parallel import distributed
from difflet_tpu import loading
from difflet_tpu.config import Config
from difflet_tpu.runner import Runner
from difflet_tpu.testing import read_fixture_io, rel_l2

HERE = pathlib.Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
WORKER = HERE / "_multiprocess_worker.py"
RUN_TIMEOUT = 420  # seconds for the whole two-process run (~40 s of CPU; minutes of wall on two busy cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFLET_TPU_", "XLA_FLAGS"))}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _wait(p, timeout, said=None):
    """(returncode, stdout, stderr, seconds) of process `p`, killed after `timeout` seconds
    (stderr then ends "[killed after `said` (default `timeout`) s]")."""
    t0 = time.monotonic()
    try:
        so, se = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        so, se = p.communicate()
        se += f"\n[killed after {said or timeout} s]"
    return p.returncode, so, se, time.monotonic() - t0


def launch(n, out, *, phases="parity,bench,die", ids=None, port=None, timeout=RUN_TIMEOUT, **flags):
    """Runs the worker as processes `ids` (default 0..n-1) of an `n`-process run;
    returns [(returncode, stdout, stderr, seconds, wall-clock end)], killing what outlives
    `timeout` (the end is when the launcher saw it exit: an upper bound)."""
    port = port or free_port()
    ids = range(n) if ids is None else ids
    extra = [x for k, v in flags.items() for x in (f"--{k.replace('_', '-')}", str(v))]
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(WORKER), "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", str(n), "--process-id", str(i), "--out", str(out),
                               "--phases", phases, *extra],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in ids]
    res = []
    for p in procs:
        rc, so, se, _ = _wait(p, max(1.0, timeout - (time.monotonic() - t0)), said=timeout)
        res.append((rc, so, se, time.monotonic() - t0, time.time()))
    return res


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("mp")
    return out, launch(2, out)


def _show(res):
    return "\n".join(f"--- process {i}: rc={rc} after {t:.1f} s\n{se[-3000:]}" for i, (rc, so, se, t, _) in enumerate(res))


@functools.lru_cache(maxsize=None)
def one_process(case):
    """The one-process, one-device result of a fixture case."""
    kw, out = read_fixture_io(FIXTURES / case)
    model = loading.load_transformer(FIXTURES / case / "transformer", dtype=jnp.float32, config=Config())
    return np.asarray(Runner(model, None, Config())(**kw).sample), out["sample"]


def _reads(out, i):
    return json.loads((out / f"reads_{i}.json").read_text())


def test_sp_and_cfg_parallel_across_processes_equal_one_process(two_processes):
    out, res = two_processes
    assert (out / "outputs.npz").exists(), _show(res)
    got = np.load(out / "outputs.npz")
    for name, case in (("sp", "wan_t2v"), ("cfg", "wan_t2v_batch2")):
        ref, diffusers = one_process(case)
        assert got[name].shape == ref.shape
        assert rel_l2(got[name], ref) <= 1e-5, name
        assert rel_l2(got[name], diffusers) <= 1e-5, name
    r0, r1 = _reads(out, 0), _reads(out, 1)
    assert r0["sp_ring"] == r1["sp_ring"] and len(r0["sp_ring"]) == 4
    assert set(r0["sp_ring"]) == set(r0["local_devices"]) | set(r1["local_devices"])  # the ring crosses processes
    assert [set(g) for g in r0["cfg_groups"]] == [set(r0["local_devices"]), set(r1["local_devices"])]


def test_cfg_denoise_steps_agree_on_every_process_and_with_one_process(two_processes):
    import dataclasses  # noqa: F401

    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu.models import wan

    out, res = two_processes
    r0, r1 = _reads(out, 0), _reads(out, 1)
    assert r0["denoise_sha256_all"] == [r0["denoise_sha256"], r1["denoise_sha256"]]
    assert r0["denoise_sha256"] == r1["denoise_sha256"]
    kw2, _ = read_fixture_io(FIXTURES / "wan_t2v_batch2")
    model = loading.load_transformer(FIXTURES / "wan_t2v_batch2" / "transformer", dtype=jnp.float32, config=Config())
    inputs = {"hidden_states": kw2["hidden_states"][:1], "timestep": kw2["timestep"][:1],
              "encoder_hidden_states": kw2["encoder_hidden_states"][1:]}
    cfg_inputs = dict(inputs, hidden_states=kw2["hidden_states"][[0, 0]],
                      encoder_hidden_states=kw2["encoder_hidden_states"], timestep=kw2["timestep"])
    pipe = wan.SPEC.pipeline
    den = PL.Denoiser(pipe, [Runner(model, None, Config())], inputs, pipe.schedule(2, inputs, "tiny"),
                      guidance=5.0, cfg_inputs=cfg_inputs, dtype=jnp.float32)
    want, _ = den.run()
    assert rel_l2(np.load(out / "outputs.npz")["denoise"], want["hidden_states"]) <= 1e-5


def test_a_whole_video_pipeline_across_processes_equals_diffusers(two_processes):
    """WanPipeline (prompt -> frames: UMT5, UniPC, CFG, the VAE decode) with its transformer
    under SP on a tp=4 ring across the two processes: the same frames on both, and diffusers'."""
    out, res = two_processes
    r0, r1 = _reads(out, 0), _reads(out, 1)
    assert r0["pipeline_sha256_all"][0] == r0["pipeline_sha256_all"][1] == r1["pipeline_sha256_all"][0]
    want = np.load(FIXTURES / "pipelines" / "wan_t2v" / "io.npz")["cfg.frames"]
    got = np.load(out / "outputs.npz")["pipeline_frames"]
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-3 and rel_l2(got, want) <= 1e-4


def test_step_cache_decisions_agree_across_processes(two_processes):
    """The tiny WanPipeline under SP across the two processes with the step cache: every decision
    and relative change the same on both processes (one value from psums over the mesh), a
    threshold between the steps' changes (0.58, 0.49 on one process's 4-device SP) so the pattern
    has a full pass and a cached call, and the same frames."""
    out, res = two_processes
    r0, r1 = _reads(out, 0), _reads(out, 1)
    assert r0["cache_decisions"] == r1["cache_decisions"], _show(res)
    assert [d["skipped"] for d in r0["cache_decisions"]] == [False, False, True]
    assert r0["cache_sha256_all"][0] == r0["cache_sha256_all"][1]


def test_sparse_attention_runs_one_program_across_processes(two_processes):
    """The tiny WanPipeline with block-sparse attention (`attention=`), its transformer under SP on
    a tp=4 ring across the two processes: the same frames on both processes (the mask is host data
    built identically on each, so both run one program), equal to the one-device call."""
    from difflet_tpu.pipeline.diffusion import DiffusionPipeline

    out, res = two_processes
    r0, r1 = _reads(out, 0), _reads(out, 1)
    assert r0["sparse_calls"] == r1["sparse_calls"] == 2, _show(res)
    assert r0["sparse_sha256_all"][0] == r0["sparse_sha256_all"][1] == r1["sparse_sha256_all"][0]
    pipe = DiffusionPipeline.from_pretrained(FIXTURES / "pipelines" / "wan_t2v", dtype=jnp.float32)
    kw = dict(prompt="a cat", height=128, width=256, num_frames=9, num_inference_steps=2, guidance_scale=5.0,
              max_sequence_length=16, seed=0, output_type="np")
    want = pipe(**kw, attention=r0["sparse_option"]).frames
    dense = pipe(**kw).frames
    got = np.load(out / "outputs.npz")["sparse_frames"]
    assert got.shape == want.shape and rel_l2(got, want) <= 1e-5, rel_l2(got, want)
    assert np.abs(want - dense).max() > 1e-4  # the sparse steps changed the video


def test_each_process_reads_only_its_own_slices(two_processes):
    """tp=4 across two processes: each process reads the two quarters of every
    tp-sharded tensor its devices hold, the other process the other two; replicated
    tensors once per process. Together: every byte of the checkpoint once per process
    that needs it, no more."""
    out, res = two_processes
    from safetensors import safe_open

    path = FIXTURES / "wan_t2v" / "transformer" / loading.SINGLE_FILE
    with safe_open(str(path), framework="np") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
    nbytes = {k: 4 * math.prod(s) for k, s in sizes.items()}
    per = [_reads(out, i)["reads_sp"] for i in (0, 1)]
    seen = {}
    for i, reads in enumerate(per):
        for key, index, n in reads:
            seen.setdefault(key, []).append((i, index, n))
    assert set(seen) == set(sizes)
    sharded = 0
    for key, hits in seen.items():
        if all(n == nbytes[key] for _, _, n in hits):  # replicated: whole, once per process
            assert sorted(i for i, _, _ in hits) == [0, 1], (key, hits)
            continue
        sharded += 1
        assert len(hits) == 4 and all(n == nbytes[key] // 4 for _, _, n in hits), (key, hits)
        assert sorted(i for i, _, _ in hits) == [0, 0, 1, 1], (key, hits)
        slices = [tuple(map(tuple, idx)) for _, idx, _ in hits]
        assert len(set(slices)) == 4, (key, hits)  # disjoint quarters: no process reads another's
    assert sharded >= 8
    total = [sum(n for _, _, n in reads) for reads in per]
    whole = sum(nbytes.values())
    assert all(t < whole for t in total), (total, whole)  # neither process read the checkpoint whole
    # cfg=2 x tp=2 with one cfg group per process: each process holds a whole tp group
    for i in (0, 1):
        reads = _reads(out, i)["reads_cfg"]
        assert sum(n for _, _, n in reads) == whole
        assert len({k for k, _, _ in reads}) == len(sizes)


def test_the_bench_reports_once_with_every_process_hash_equal(two_processes):
    out, res = two_processes
    table0 = (out / "bench_0.txt").read_text()
    table1 = (out / "bench_1.txt").read_text()
    assert "wan:tiny" in table0 and "cfg=2,tp=2" in table0, _show(res)
    assert "wan:tiny" not in table1  # process 1 does not report
    assert not (out / "bench_1.json").exists()
    rows = json.loads((out / "bench_0.json").read_text())
    assert rows["processes"] == 2 and rows["devices"] == 4
    (row,) = rows["results"]
    assert row["sha256_agree"] and row["sha256_processes"] == [row["sha256"]] * 2
    assert row["mesh"] == "cfg=2,tp=2" and row["compilations_timed"] == 0


def test_a_dead_peer_stops_the_survivor_with_a_clear_error(two_processes):
    """Process 1 exits abruptly after a step. Process 0 stops within seconds with a clear
    error, by whichever notices first: its next collective fails (the bench's path: the
    message and exit status EXIT_PEER_LOST), or JAX's coordination service sees the
    lost task and terminates it with its own message."""
    out, res = two_processes
    (rc0, _, se0, _, end0), (rc1, _, se1, _, _) = res
    assert rc1 == 17, _show(res)
    assert "killed after" not in se0, _show(res)
    ours = rc0 == distributed.EXIT_PEER_LOST and "error: a peer process is gone" in se0
    jaxs = rc0 != 0 and "Terminating process because the JAX distributed service detected fatal errors" in se0
    assert ours or jaxs, _show(res)
    died = float((out / "died_at").read_text())
    noticed = float((out / "error_at").read_text()) if ours else end0
    assert 0 <= noticed - died < 30, noticed - died


def test_an_absent_coordinator_is_a_clear_error_in_bounded_time(tmp_path):
    """Process 1 of 2 with no process 0 listening: DistributedError after the timeout."""
    (rc, so, se, t, _), = launch(2, tmp_path, ids=[1], phases="parity", init_timeout=3, timeout=90)
    assert rc == 2, se
    assert "no JAX coordinator answered at 127.0.0.1:" in se and "within 3 s" in se, se
    assert "killed after" not in se


def test_a_peer_that_never_joins_ends_the_run_in_bounded_time(tmp_path):
    """Process 0 of 2 alone: the join watchdog stops it after --init-timeout with a message
    saying how many processes joined and what to check, before jax's own abort (exit 134,
    "DEADLINE_EXCEEDED", which says neither)."""
    (rc, so, se, t, _), = launch(2, tmp_path, ids=[0], phases="parity", init_timeout=3, timeout=90)
    assert rc == distributed.EXIT_JOIN_FAILED and "killed after" not in se, se[-2000:]
    assert "error: process 0/2: 1 of 2 processes joined (this one) at 127.0.0.1:" in se, se[-2000:]
    assert "within --init-timeout 3 s. Check that every process was started with the same --coordinator and " \
           "--num-processes 2" in se
    assert "DEADLINE_EXCEEDED" not in se and "process 0/2 joining 127.0.0.1:" in se


def _bench(port, n, i, *extra):
    return subprocess.Popen([sys.executable, "-m", "difflet_tpu.bench", "--coordinator", f"127.0.0.1:{port}",
                             "--num-processes", str(n), "--process-id", str(i), "--cpu-devices", "2",
                             "--model", "wan:tiny", "--steps", "2", *extra],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)



@pytest.mark.parametrize("other_id", [0, 1])
def test_a_one_process_run_beside_a_two_process_run_ends_both_with_a_message(tmp_path, other_id):
    """--num-processes 1 and 2 on one coordinator (before: the lone process served a
    one-process run and exited 0, the other aborted inside jax with exit 134 and no
    clear message). The lone process refuses the coordinator it does not need; the
    other ends within its --init-timeout saying how many processes joined."""
    port = free_port()
    lone, other = _bench(port, 1, 0), _bench(port, 2, other_id, "--init-timeout", "5")
    rc1, so1, se1, _ = _wait(lone, 60)
    rc2, so2, se2, t2 = _wait(other, 60)
    assert rc1 == 2 and "error: --num-processes 1 with --coordinator 127.0.0.1:" in se1, se1[-2000:]
    assert "start every process with the same --num-processes" in se1 and "step ms" not in so1
    assert rc2 == 2 and "killed after" not in se2, se2[-2000:]
    want = ("1 of 2 processes joined (this one)" if other_id == 0
            else "no JAX coordinator answered at 127.0.0.1:")
    assert want in se2 and "--num-processes" in se2, se2[-2000:]
    assert "step ms" not in so2


def test_processes_started_differently_are_refused_on_every_process(tmp_path):
    """Two bench processes that differ in --steps: both refuse right after joining, with one
    message naming the difference, before any model is built or any collective runs
    (before: both ran different programs into gloo's own timeout)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "difflet_tpu.bench", "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i), "--cpu-devices", "2",
                               "--model", "wan:tiny", "--steps", str(2 + i), "--init-timeout", "60"],
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    res = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
            se += "\n[killed after 180 s]"
        res.append((p.returncode, so, se))
    for rc, so, se in res:
        assert rc == 2, se[-3000:]
        assert "were started with different bench arguments" in se, se[-3000:]
        diffs = [line for line in se.splitlines() if line.startswith("  ") and ": process 0 " in line]
        assert diffs == ["  steps: process 0 2, process 1 3"], se[-3000:]
        assert "step ms" not in so  # no table: nothing ran


STALL = """
import os, sys, time
from difflet_tpu.parallel import distributed
port, pid = sys.argv[1], int(sys.argv[2])
distributed.initialize(f"127.0.0.1:{port}", 2, pid, cpu_devices=1, init_timeout_s=30, heartbeat_timeout_s=4)
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
f = jax.jit(jax.shard_map(lambda a: jax.lax.psum_scatter(a, "x", tiled=True), mesh=mesh, in_specs=P("x"),
                          out_specs=P("x")))
x = jax.make_array_from_callback((8,), NamedSharding(mesh, P("x")), lambda i: np.ones(8, np.float32)[i])
jax.block_until_ready(f(x))
print("first collective done", file=sys.stderr, flush=True)
if pid == 1:
    time.sleep(300)  # stalls, alive: its heartbeats go on
t0 = time.monotonic()
try:
    jax.block_until_ready(f(x))
except Exception as e:
    print(f"failed after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    os._exit(3)
"""


def test_a_collective_waiting_on_a_stalled_peer_ends_after_the_heartbeat_timeout():
    """Process 1 stalls (alive, heartbeating) before a reduce-scatter; process 0's collective
    gives up after --heartbeat-timeout (4 s) with gloo's error, instead of XLA's default
    30 min (`distributed.bound_cpu_collectives`)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", STALL, str(port), str(i)], env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        rc, _, se, _ = _wait(procs[0], 60)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert rc == 3 and "first collective done" in se, se[-3000:]
    line = next(x for x in se.splitlines() if x.startswith("failed after"))
    waited = re.search(r"Timed out waiting (\d+)ms", line)  # gloo counts what was left of the 4 s: 3997 .. 4000
    assert "ReduceScatter timed out" in line and waited and 3500 <= int(waited.group(1)) <= 4000, line
    assert 3.5 <= float(line.split()[2]) < 15, line
