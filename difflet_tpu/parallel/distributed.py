"""Multi-host slices on JAX's multi-controller runtime (`jax.distributed`).

A v5e-16 or a v6e-16 spans several hosts (TPU VM workers). JAX runs one
Python process per host; every process runs the same program on the global
mesh (every process's devices), holds only its own devices' shards, and the
collectives cross hosts over ICI as they do within one
(https://docs.jax.dev/en/latest/multi_process.html). This module is that
entry point for difflet_tpu:

* `initialize(...)` starts `jax.distributed` before jax creates its backends:
  with no arguments on a TPU VM slice (jax reads the slice from the TPU
  environment, one process per worker), or with an explicit coordinator,
  process count and id (CPU tests, other clusters). CPU processes use gloo
  collectives (`jax_cpu_collectives_implementation`).
* after it, `difflet_tpu.make_mesh(...)` meshes over every process's devices,
  `weights.load_transformer(..., mesh=mesh)` reads on each process only the
  slices of its addressable devices (`place_from_callback`), and a `Runner`
  places the same host inputs on every process (each keeps its shards).
* `gather_strings` / `all_equal` compare per-process values (the bench's
  sha256 of the final latents) so process 0 can report once.

Failures are bounded in time, never a hang:

* no coordinator (process 0 absent, a wrong address): a non-zero process
  probes the coordinator's TCP port before connecting and raises
  `DistributedError` after `init_timeout_s`;
* a process that never joins (or one started with another process count):
  a watchdog stops every waiting process after `init_timeout_s` with a message
  saying how many joined and what to check (`EXIT_JOIN_FAILED`), before
  jax's own fatal "DEADLINE EXCEEDED ... RegisterTask" abort (the bench
  refuses `--num-processes 1` with a coordinator: only a mistake could join it);
* a peer that stalls mid-run (CPU): every gloo collective gives up after
  `heartbeat_timeout_s` (`bound_cpu_collectives`; XLA's default is 30 min);
  on TPU, collectives over ICI have no such bound: JAX's heartbeat covers a
  process that dies, not one that stalls (docs/multi-host.md);
* a peer that dies mid-run: the next collective with it fails at once
  (CPU: gloo's "Connection closed by peer"; `peer_failure` recognises it and
  the bench exits with `EXIT_PEER_LOST`), and a peer that stops sending
  heartbeats is declared dead after `heartbeat_timeout_s`, when JAX's
  coordination service terminates the others with "Terminating process
  because the JAX distributed service detected fatal errors".
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
import time

EXIT_PEER_LOST = 3  # the bench's exit status when a peer process is gone
EXIT_JOIN_FAILED = 2  # not every process joined within --init-timeout (as the bench's other refusals)
# jax's own give-up on joining is a fatal abort (exit 134, "DEADLINE_EXCEEDED ... RegisterTask") that
# says neither who joined nor what to check: it is given this much longer, so our watchdog speaks first.
JOIN_GRACE_S = 10

# What jax / gloo / the coordination service say when a peer is gone.
_PEER_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe", "gloo",
               "heartbeat", "coordination service", "unavailable: ", "task is set to error",
               "failed to connect", "socket closed")


class DistributedError(RuntimeError):
    """A multi-process run could not start or lost a process; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """This process in the run: its index, the process count, its devices and all devices."""

    index: int
    count: int
    local_devices: tuple
    devices: tuple

    @property
    def is_reporter(self) -> bool:
        """Process 0 reports (tables, JSON); the others stay quiet."""
        return self.index == 0


def info() -> ProcessInfo:
    """The current process's place in the run (one process: index 0 of 1)."""
    import jax

    return ProcessInfo(jax.process_index(), jax.process_count(), tuple(jax.local_devices()),
                       tuple(jax.devices()))


def is_initialized() -> bool:
    import jax

    return jax.distributed.is_initialized()


def _split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit():
        raise DistributedError(f"coordinator address {address!r} is not HOST:PORT (e.g. 10.0.0.2:8476)")
    if not 1 <= int(port) <= 65535:
        raise DistributedError(f"coordinator address {address!r}: port {int(port)} is outside 1..65535")
    return host.strip("[]"), int(port)


def wait_for_coordinator(address: str, timeout_s: float) -> float:
    """Seconds until the coordinator at `address` accepts TCP connections; raises
    `DistributedError` after `timeout_s` seconds without one."""
    host, port = _split_address(address)
    t0 = time.monotonic()
    last = None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, timeout_s))):
                return time.monotonic() - t0
        except OSError as e:
            last = e
        if time.monotonic() - t0 >= timeout_s:
            raise DistributedError(
                f"no JAX coordinator answered at {address} within {timeout_s:g} s ({last}), so no process "
                f"joined: process 0 serves it, so start process 0 with the same coordinator address and "
                f"--num-processes, or check the address, the port and the firewall")
        time.sleep(0.2)


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None, cpu_devices: int | None = None,
               init_timeout_s: int = 300, heartbeat_timeout_s: int = 100) -> ProcessInfo:
    """Starts `jax.distributed` for this process (once; a second call returns `info()`).

    Args:
      coordinator_address, num_processes, process_id: all three, or none. None:
        jax's cluster detection (a Cloud TPU VM slice: every worker runs the same
        command; also Slurm / Open MPI). Process 0 serves the coordinator at that
        address; the others connect to it.
      local_device_ids: restrict this process to these local devices (jax's).
      cpu_devices: on CPU, this many virtual devices in this process (tests).
      init_timeout_s: how long processes wait for the coordinator and for each other.
      heartbeat_timeout_s: a process silent this long is declared dead and the
        others are terminated (JAX's coordination service).

    Must run before jax creates its backends (before any jax computation).
    """
    import jax

    if jax.distributed.is_initialized():
        return info()
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise DistributedError("difflet_tpu.parallel.distributed.initialize must run before any jax computation "
                               "(jax has already created its backends in this process)")
    given = [v is not None for v in (coordinator_address, num_processes, process_id)]
    if any(given) and not all(given):
        raise DistributedError("give coordinator_address, num_processes and process_id together, or none of "
                               "them (cluster detection: a TPU VM slice, Slurm, Open MPI)")
    if all(given):
        if not isinstance(num_processes, int) or num_processes < 1:
            raise DistributedError(f"num_processes={num_processes!r} must be an int >= 1")
        if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
            raise DistributedError(f"process_id={process_id!r} must be an int in [0, {num_processes})")
        _split_address(coordinator_address)
    for name, v in (("init_timeout_s", init_timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
        if not isinstance(v, int) or v < 1:
            raise DistributedError(f"{name}={v!r} must be an int >= 1 (seconds)")
    if cpu_devices is not None:
        from difflet_tpu.parallel.mesh import use_cpu_devices

        use_cpu_devices(cpu_devices)
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu" or cpu_devices is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        bound_cpu_collectives(heartbeat_timeout_s)
    who = "this process" if process_id is None else f"process {process_id}/{num_processes}"
    where = coordinator_address or "the coordinator found by cluster detection"
    print(f"difflet_tpu.parallel.distributed: {who} joining {where} (waiting up to {init_timeout_s} s for every "
          f"process; a silent process is declared dead after {heartbeat_timeout_s} s)", file=sys.stderr, flush=True)
    if process_id is not None and process_id != 0:
        wait_for_coordinator(coordinator_address, init_timeout_s)
    # every wait of the runtime follows the two timeouts (the CPU topology exchange counts in minutes)
    jax.config.update("jax_cpu_get_global_topology_timeout_minutes", max(1, -(-init_timeout_s // 60)))
    watchdog = threading.Timer(init_timeout_s, _join_timed_out, (coordinator_address, num_processes, process_id,
                                                                 init_timeout_s))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids,
                                   initialization_timeout=init_timeout_s + JOIN_GRACE_S,
                                   heartbeat_timeout_seconds=heartbeat_timeout_s, shutdown_timeout_seconds=init_timeout_s)
    finally:
        watchdog.cancel()
    return info()


def bound_cpu_collectives(timeout_s: int) -> None:
    """Every CPU (gloo) collective of this process gives up after `timeout_s` seconds with an
    error naming the collective ("Gloo ReduceScatter timed out"), instead of XLA's default
    30 min: XLA's `xla_cpu_collective_timeout_seconds` (all-gather, all-reduce, reduce-scatter,
    permute, all-to-all). Its in-process rendezvous abort follows a little later so the error
    comes first. Read when jax creates its backends, so set before; a value already in
    XLA_FLAGS wins."""
    flags = os.environ.get("XLA_FLAGS", "")
    for name, value in (("xla_cpu_collective_timeout_seconds", timeout_s),
                        ("xla_cpu_collective_call_terminate_timeout_seconds", timeout_s + JOIN_GRACE_S)):
        if f"--{name}=" not in flags:
            flags = f"{flags} --{name}={value}".strip()
    os.environ["XLA_FLAGS"] = flags


def _join_timed_out(address, n, me, timeout_s) -> None:
    """The join watchdog: not every process registered within `timeout_s`. Says who is
    waiting, how many joined as far as this process can tell, and what to check; exits
    with EXIT_JOIN_FAILED (jax's connect cannot be interrupted from Python)."""
    where = address or "the coordinator found by cluster detection"
    if n is None:
        joined = "not every process of the slice joined"
    elif me == 0:  # the coordinator's side: it registered, at least one other did not
        joined = f"1 of {n} processes joined (this one)" if n == 2 else f"fewer than {n} processes joined"
    else:
        joined = f"the coordinator answered, but fewer than {n} processes joined"
    who = "this process" if me is None else f"process {me}/{n}"
    print(f"error: {who}: {joined} at {where} within --init-timeout {timeout_s} s. Check that every process was "
          f"started with the same --coordinator and --num-processes {n if n else 'N'}, with the process ids "
          f"0..{n - 1 if n else 'N-1'} each once, and that none has exited (its own message says why)",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_JOIN_FAILED)


def check_same_run(values: dict, timeout_s: int, what: str = "run arguments") -> None:
    """Every process was started with the same `values` (e.g. the bench's arguments but
    the process id); a DistributedError on every process naming each difference otherwise.

    Exchanged through the coordination service's key-value store right after joining,
    before any collective: processes that disagree (other --steps, --mesh, --model) would
    otherwise run different programs and end in a collective's timeout (on CPU
    --heartbeat-timeout, `bound_cpu_collectives`) with an unclear error, or, worse, both report. A process that does not
    publish within `timeout_s` seconds is an error too."""
    import json

    import jax
    from jax._src import distributed as jax_distributed

    me, n = jax.process_index(), jax.process_count()
    client = jax_distributed.global_state.client
    if n == 1 or client is None:
        return
    key = "difflet_tpu/run_args/{}"
    client.key_value_set(key.format(me), json.dumps(values, sort_keys=True, default=str))
    got = {}
    for i in range(n):
        try:
            got[i] = json.loads(client.blocking_key_value_get(key.format(i), int(timeout_s * 1000)))
        except Exception as e:  # noqa: BLE001 - the runtime's deadline error
            raise DistributedError(f"process {i} did not publish its {what} within {timeout_s} s "
                                   f"({type(e).__name__}); was every process started with this version and "
                                   f"--num-processes {n}?") from None
    diffs = []
    for name in sorted(set().union(*(set(v) for v in got.values()))):
        seen = [got[i].get(name) for i in range(n)]
        if any(v != seen[0] for v in seen):
            diffs.append(f"{name}: " + ", ".join(f"process {i} {v!r}" for i, v in enumerate(seen)))
    if diffs:
        raise DistributedError(f"the {n} processes were started with different {what} (every process must run "
                               f"the same command but its process id):\n  " + "\n  ".join(diffs))


def peer_failure(exc: BaseException) -> bool:
    """Whether `exc` (from a step of a multi-process run) says a peer process is gone."""
    if not is_initialized():
        return False
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(s in text for s in _PEER_SIGNS)


def exit_peer_lost(exc: BaseException, what: str = "the run") -> None:
    """Reports a lost peer and exits with `EXIT_PEER_LOST` at once: jax's exit
    hooks would wait at a shutdown barrier the dead peer never reaches."""
    print(f"error: a peer process is gone (or stalled past --heartbeat-timeout in a collective), {what} "
          f"cannot continue "
          f"(process {info().index}/{info().count}): {type(exc).__name__}: {str(exc)[:500]}",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(EXIT_PEER_LOST)


def gather_strings(value: str, width: int = 64) -> list[str]:
    """`value` (ASCII, at most `width` characters) from every process, in process order."""
    import numpy as np

    if len(value) > width:
        raise ValueError(f"gather_strings: {len(value)} characters > {width}")
    if not is_initialized() or info().count == 1:
        return [value]
    from jax.experimental import multihost_utils

    buf = np.zeros((width,), np.uint8)
    buf[:len(value)] = np.frombuffer(value.encode("ascii"), np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf))
    return [bytes(r).rstrip(b"\0").decode("ascii") for r in rows.reshape(-1, width)]


def all_equal(value: str) -> tuple[bool, list[str]]:
    """(every process has the same `value`, the values in process order)."""
    values = gather_strings(value)
    return len(set(values)) == 1, values


def fetch(x):
    """The whole of a (possibly multi-process) jax array as numpy on every process
    (replicated arrays directly; others gathered across processes)."""
    import jax
    import numpy as np

    if not isinstance(x, jax.Array) or x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
