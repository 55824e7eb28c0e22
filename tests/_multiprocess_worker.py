"""One process of the multi-process CPU tests (tests/test_distributed.py).

    python tests/_multiprocess_worker.py --coordinator 127.0.0.1:PORT --num-processes N
        --process-id I --out DIR [--phases parity,bench,die] [--init-timeout S] [--heartbeat-timeout S]

Each process has 2 virtual CPU devices and joins the run with
`difflet_tpu.parallel.distributed.initialize` (gloo collectives). Phases, in order:

* parity: the wan_t2v fixture under SP on a tp=4 ring across the processes and
  wan_t2v_batch2 on a cfg=2 x tp=2 mesh (each cfg group on one process), each
  loaded with every `Checkpoint.read` counted; two CFG denoise steps on the
  cfg mesh; the tiny WanPipeline (tests/fixtures/pipelines/wan_t2v, its CFG call) under SP on
  the tp=4 ring, uncached and with the step cache (each process's decisions written). Writes DIR/reads_<I>.json and, on process 0, DIR/outputs.npz.
* bench: `python -m difflet_tpu.bench` in this process (wan:tiny, cfg=2,tp=2, SP,
  2 steps); its stdout to DIR/bench_<I>.txt.
* die: process 1 exits abruptly after one step; process 0 keeps stepping and
  must stop with a clear error (exit status `distributed.EXIT_PEER_LOST`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import sys
import time

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
SPARSE = "sta:window=1,2,1,tile=2,4,16"  # the tiny Wan folder at 128x256x9: 2 x 2 x 1 tiles of 128 tokens


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--phases", default="parity,bench,die")
    ap.add_argument("--init-timeout", type=int, default=120)
    ap.add_argument("--heartbeat-timeout", type=int, default=30)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    pid = args.process_id

    os.environ["JAX_PLATFORMS"] = "cpu"
    from difflet_tpu.parallel import distributed

    t0 = time.monotonic()
    try:
        me = distributed.initialize(args.coordinator, args.num_processes, pid, cpu_devices=2,
                                    init_timeout_s=args.init_timeout, heartbeat_timeout_s=args.heartbeat_timeout)
    except distributed.DistributedError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"process {me.index}/{me.count} joined in {time.monotonic() - t0:.1f} s: "
          f"{len(me.local_devices)} local of {len(me.devices)} devices", file=sys.stderr, flush=True)
    phases = args.phases.split(",")
    if "parity" in phases:
        parity(out, pid)
    if "bench" in phases:
        from difflet_tpu.bench import cli

        with open(out / f"bench_{pid}.txt", "w") as f, contextlib.redirect_stdout(f):
            rc = cli.main(["--coordinator", args.coordinator, "--num-processes", str(args.num_processes),
                             "--process-id", str(pid), "--cpu-devices", "2", "--model", "wan:tiny",
                             "--mesh", "cfg=2,tp=2", "--mode", "sp", "--steps", "2",
                             "--json", str(out / f"bench_{pid}.json")])
        if rc:
            return rc
    if "die" in phases:
        die(out, pid)
    return 0


def parity(out, pid):
    import jax.numpy as jnp
    import numpy as np

    from difflet_tpu.parallel import distributed
    from difflet_tpu.pipeline import denoise as PL
    from difflet_tpu import loading
    from difflet_tpu.config import Config
    from difflet_tpu.parallel.mesh import make_mesh, tp_groups
    from difflet_tpu.models import wan
    from difflet_tpu.runner import Runner
    from difflet_tpu.testing import read_fixture_io

    reads = []
    orig = loading.Checkpoint.read

    def counting(self, key, index=None):
        a = orig(self, key, index)
        reads.append([key, None if index is None else [[s.start, s.stop] for s in index], int(a.nbytes)])
        return a

    loading.Checkpoint.read = counting
    res = {"local_devices": [d.id for d in distributed.info().local_devices]}
    outputs = {}

    # SP on one tp=4 ring across both processes
    mesh = make_mesh(4)
    res["sp_ring"] = tp_groups(mesh)[0]
    kw, _ = read_fixture_io(FIXTURES / "wan_t2v")
    reads.clear()
    model = loading.load_transformer(FIXTURES / "wan_t2v" / "transformer", dtype=jnp.float32, mesh=mesh,
                                     config=Config())
    res["reads_sp"] = list(reads)
    outputs["sp"] = distributed.fetch(Runner(model, mesh, Config(), "sp")(**kw).sample)

    # CFG-parallel: [unconditional | conditional] rows on the two cfg groups (one per process)
    mesh = make_mesh(cfg=2)
    res["cfg_groups"] = tp_groups(mesh)
    kw2, _ = read_fixture_io(FIXTURES / "wan_t2v_batch2")
    reads.clear()
    model = loading.load_transformer(FIXTURES / "wan_t2v_batch2" / "transformer", dtype=jnp.float32, mesh=mesh,
                                     config=Config())
    res["reads_cfg"] = list(reads)
    run = Runner(model, mesh, Config(), "sp")
    outputs["cfg"] = distributed.fetch(run(**kw2).sample)

    # Two CFG denoise steps: the combine is one all-reduce over cfg; every process holds the latents
    spec = wan.SPEC
    inputs = {"hidden_states": kw2["hidden_states"][:1], "timestep": kw2["timestep"][:1],
              "encoder_hidden_states": kw2["encoder_hidden_states"][1:]}
    cfg_inputs = dict(inputs, hidden_states=kw2["hidden_states"][[0, 0]],
                      encoder_hidden_states=kw2["encoder_hidden_states"], timestep=kw2["timestep"])
    den = PL.Denoiser(spec.pipeline, [run], inputs, spec.pipeline.schedule(2, inputs, "tiny"), guidance=5.0,
                      cfg_inputs=cfg_inputs, dtype=jnp.float32)
    final, _ = den.run()
    from difflet_tpu.bench.run import sha256

    res["denoise_sha256"] = sha256(final)
    res["denoise_sha256_all"] = distributed.gather_strings(res["denoise_sha256"])
    outputs["denoise"] = final["hidden_states"]

    # A whole pipeline: the tiny WanPipeline (UMT5, UniPC, CFG, the VAE) under SP on the tp=4 ring
    from difflet_tpu.pipeline.diffusion import DiffusionPipeline

    folder = FIXTURES / "pipelines" / "wan_t2v"
    call = json.loads((folder / "calls.json").read_text())["calls"]["cfg"]["kwargs"]
    pipe = DiffusionPipeline.from_pretrained(folder, mesh=make_mesh(4), dtype=jnp.float32, config=Config(sp=True))
    frames = pipe(**call, latents=np.load(folder / "io.npz")["cfg.latents"], output_type="np").frames
    res["pipeline_sha256_all"] = distributed.gather_strings(sha256({"frames": frames}))
    outputs["pipeline_frames"] = frames
    # the step cache: each process reads its decisions from its own devices (psums over the mesh)
    cached = pipe(**call, latents=np.load(folder / "io.npz")["cfg.latents"], output_type="np",
                  cache="first-block:threshold=0.53,warmup=1,max_skips=100")
    res["cache_decisions"] = cached.stats["decisions"]
    res["cache_sha256_all"] = distributed.gather_strings(sha256({"frames": cached.frames}))
    # block-sparse attention: the host-built mask is the same data on every process (one program)
    sparse = pipe(prompt="a cat", height=128, width=256, num_frames=9, num_inference_steps=2, guidance_scale=5.0,
                  max_sequence_length=16, seed=0, output_type="np", attention=SPARSE)
    res["sparse_calls"], res["sparse_option"] = sparse.stats["sparse_calls"], SPARSE
    res["sparse_sha256_all"] = distributed.gather_strings(sha256({"frames": sparse.frames}))
    outputs["sparse_frames"] = sparse.frames
    (out / f"reads_{pid}.json").write_text(json.dumps(res))
    if pid == 0:
        np.savez(out / "outputs.npz", **outputs)


def die(out, pid):
    import jax.numpy as jnp
    from flax import nnx

    from difflet_tpu.parallel import distributed
    from difflet_tpu.config import Config
    from difflet_tpu.parallel.mesh import make_mesh
    from difflet_tpu.runner import Runner
    from difflet_tpu.testing import register_toy_port

    spec = register_toy_port()
    cfg = spec.config_from_diffusers(spec.presets["tiny"])
    run = Runner(spec.build(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)), make_mesh(4), Config(), "sp")
    kw = spec.example_inputs(cfg, batch=1, seed=0)
    distributed.fetch(run(**kw).sample)  # both processes are here once
    if pid == 1:
        (out / "died_at").write_text(repr(time.time()))
        print("process 1: exiting abruptly", file=sys.stderr, flush=True)
        os._exit(17)
    for i in range(1000):
        try:
            distributed.fetch(run(**kw).sample)
        except Exception as e:  # noqa: BLE001 - the peer is gone
            if distributed.peer_failure(e):
                (out / "error_at").write_text(repr(time.time()))
                distributed.exit_peer_lost(e, "the die test")
            raise
        time.sleep(0.05)
    print("process 0: the peer's death went unnoticed", file=sys.stderr, flush=True)
    sys.exit(1)


if __name__ == "__main__":
    sys.exit(main())
