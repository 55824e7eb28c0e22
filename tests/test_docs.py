"""The docs' Python snippets run: every ```python block of README.md and docs/**/*.md.

A ```python block is code a reader can copy; shell commands are ```bash and
illustrative text (schedules, error messages, diagrams) ```text, and every fence
names its language (checked here), so no snippet escapes by being untagged.

Each doc's snippets run in one subprocess (4 CPU devices; XLA's CPU optimisation
level 0, which keeps the tiny compiles fast and does not change the numbers), in
order, each in a fresh namespace:

  preamble  defines what the snippet takes as given (`latents`, `t5`, ...: the
            fixture's diffusers inputs, `io.npz`); not shown to the reader
  snippet   the block as printed, after SNIPPETS' substitutions: what a reader
            has (a released model folder, a bucket, /mnt/disks) -> the committed
            fixtures (tests/fixtures/<case>/transformer) or a tmp dir
  check     asserts the snippet's result against the fixture's diffusers output

The snippets load in bf16 (the default) and the fixtures are float32 diffusers
outputs, so the checks allow bf16's error: 0.008 for Wan and LTX-2, but 0.28
for FLUX and 0.035 for Qwen-Image, because the timestep is cast to the model
dtype as diffusers casts it (FLUX: 0.75 -> 752 after the x1000 in bf16; the
float32 port given the bf16-rounded timesteps is off the fixture by the same
amounts, checked once by hand).

A snippet's tracebacks name the doc and its line. Every substitution must occur
in its block, and every table entry must name a block that exists, so the table
cannot drift from the docs either.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
FENCE = re.compile(r"^```(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
    doc: str       # path relative to the repo root
    line: int      # 1-based line of the first code line
    lang: str
    code: str


def doc_files() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of a markdown file (fences at the start of a line)."""
    doc = path.relative_to(ROOT).as_posix()
    out, open_at, lang, body = [], None, "", []
    for i, text in enumerate(path.read_text().split("\n"), 1):
        m = FENCE.match(text)
        if m is None:
            if open_at is not None:
                body.append(text)
        elif open_at is None:
            open_at, lang, body = i, m.group(1).strip(), []
        else:
            out.append(Block(doc, open_at + 1, lang, "\n".join(body) + "\n"))
            open_at = None
    if open_at is not None:
        raise ValueError(f"{doc}:{open_at}: a ``` fence that is never closed")
    return out


def python_blocks(doc: str) -> list[Block]:
    return [b for b in blocks(ROOT / doc) if b.lang == "python"]


# --------------------------------------------------------------------------
# What each snippet takes as given, and what it must produce
# --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Snippet:
    subs: tuple = ()      # (as printed, as run); "{fixtures}", "{tmp}", "{port}" are filled in
    preamble: str = ""
    check: str = ""


FLUX_INPUTS = """
kw, expected = read_fixture_io(FIXTURES / "flux")
latents, t5, clip = kw["hidden_states"], kw["encoder_hidden_states"], kw["pooled_projections"]
t, img_ids, txt_ids, guidance = kw["timestep"] * 1000, kw["img_ids"], kw["txt_ids"], kw["guidance"]
"""
# bf16 against diffusers' float32: the timestep rounding (module docstring) gives 0.28;
# a wrong input gives > 0.7.
FLUX_CHECK = """
assert type(out).__name__ == "Transformer2DModelOutput" and sample is out.sample
assert sample.shape == expected["sample"].shape
assert rel_l2(sample, expected["sample"]) < 0.3, rel_l2(sample, expected["sample"])
"""
WAN_INPUTS = """
kw, expected = read_fixture_io(FIXTURES / "wan_t2v")
latents, timestep, prompt_embeds = kw["hidden_states"], kw["timestep"], kw["encoder_hidden_states"]
"""
# `model` must hold the fixture's weights: the port reproduces diffusers' output.
WAN_MODEL_CHECK = """
import difflet_tpu
assert type(model).__name__ == "WanTransformer3DModel"
sample = difflet_tpu.Runner(model, make_mesh())(**kw).sample
assert rel_l2(sample, expected["sample"]) < 0.02, rel_l2(sample, expected["sample"])
"""

SNIPPETS = {
    ("README.md", 0): Snippet(
        subs=(("FLUX.1-dev/transformer", "{fixtures}/flux/transformer"), ("/tmp/difflet-cache", "{tmp}/cache")),
        preamble=FLUX_INPUTS,
        check=FLUX_CHECK + """
assert any((TMP / "cache").iterdir()), "cache_dir= wrote no cache entry"
"""),
    ("docs/loading.md", 0): Snippet(
        subs=(("/mnt/disks/models/wan2.1-t2v-14b/transformer", "{fixtures}/wan_t2v/transformer"),
              ("/mnt/disks/cache/difflet", "{tmp}/cache")),
        preamble=WAN_INPUTS,
        check=WAN_MODEL_CHECK + """
assert any((TMP / "cache").iterdir()), "cache_dir= wrote no cache entry"
"""),
    ("docs/loading.md", 1): Snippet(
        subs=(("/mnt/disks/models/wan2.1-t2v-14b/transformer", "{fixtures}/wan_t2v/transformer"),
              ("gs://bucket/wan2.1-t2v-14b-bf16", "{tmp}/wan2.1-t2v-14b-bf16")),
        # the restored model is the loaded one: every array and its sharding
        check="""
import jax
from flax import nnx
fresh = loading.load_transformer(path, dtype=jnp.bfloat16, mesh=mesh)
got, want = jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(fresh))
assert len(got) == len(want) > 0
for g, w in zip(got, want):
    assert g.dtype == w.dtype and g.sharding.is_equivalent_to(w.sharding, g.ndim)
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
"""),
    # A one-process "slice" of 4 CPU devices: jax.distributed with an explicit
    # coordinator instead of a TPU VM's environment, and a mesh that fits it.
    ("docs/multi-host.md", 0): Snippet(
        subs=(("distributed.initialize()", 'distributed.initialize("127.0.0.1:{port}", 1, 0, cpu_devices=4)'),
              ("make_mesh(cfg=2, tp=8)", "make_mesh(cfg=2, tp=2)"),
              ("Wan2.1-T2V-14B-Diffusers/transformer", "{fixtures}/wan_t2v/transformer")),
        check="""
assert (me.index, me.count, len(me.devices)) == (0, 1, 4)
assert dict(mesh.shape) == {"cfg": 2, "tp": 2}
kw, expected = read_fixture_io(FIXTURES / "wan_t2v_batch2")   # a batch of 2: one row per cfg group
sample = difflet_tpu.Runner(model, mesh)(**kw).sample
assert rel_l2(sample, expected["sample"]) < 0.02, rel_l2(sample, expected["sample"])
"""),
    ("docs/models/flux.md", 0): Snippet(
        subs=(("FLUX.1-dev/transformer", "{fixtures}/flux/transformer"),),
        preamble=FLUX_INPUTS, check=FLUX_CHECK),
    ("docs/models/wan.md", 0): Snippet(
        subs=(("Wan2.1-T2V-14B-Diffusers/transformer", "{fixtures}/wan_t2v/transformer"),
              ("Wan2.2-T2V-A14B-Diffusers", "{tmp}/Wan2.2-T2V-A14B-Diffusers")),
        # Wan2.2 A14B's folder: the fixture's transformer as both experts
        preamble=WAN_INPUTS + """
a14b = TMP / "Wan2.2-T2V-A14B-Diffusers"
a14b.mkdir()
(a14b / "model_index.json").write_text('{"boundary_ratio": 0.875}')
for sub in ("transformer", "transformer_2"):
    (a14b / sub).symlink_to(FIXTURES / "wan_t2v" / "transformer")
""",
        check="""
assert experts.low is not None and experts.expert_for(timestep) == "low"   # t = 500 < 875
assert rel_l2(sample, expected["sample"]) < 0.02, rel_l2(sample, expected["sample"])
"""),
    ("docs/models/ltx2.md", 0): Snippet(
        subs=(("LTX-2/transformer", "{fixtures}/ltx2/transformer"),
              ("num_frames=7, height=15, width=22", "num_frames=2, height=3, width=4"),
              ("audio_num_frames=51", "audio_num_frames=5")),
        preamble="""
kw, expected = read_fixture_io(FIXTURES / "ltx2")
v, a, ts = kw["hidden_states"], kw["audio_hidden_states"], kw["timestep"]
t, ta = kw["encoder_hidden_states"], kw["audio_encoder_hidden_states"]
m, ma = kw["encoder_attention_mask"], kw["audio_encoder_attention_mask"]
""",
        check="""
assert type(out).__name__ == "AudioVisualModelOutput"
assert rel_l2(video, expected["sample"]) < 0.02, rel_l2(video, expected["sample"])
assert rel_l2(audio, expected["audio_sample"]) < 0.02, rel_l2(audio, expected["audio_sample"])
"""),
    ("docs/models/hunyuan_video.md", 0): Snippet(
        subs=(('"HunyuanVideo"', '"{fixtures}/pipelines/hunyuan_video"'),
              ("height=320, width=512, num_frames=61,\n             num_inference_steps=30",
               "height=16, width=16, num_frames=5,\n             num_inference_steps=2"),
              ('"cat.mp4"', '"{tmp}/cat.mp4"')),
        check="""
assert video.shape == (5, 16, 16, 3) and 0.0 <= video.min() and video.max() <= 1.0
assert (TMP / "cat.mp4").stat().st_size > 0
"""),
    ("docs/video.md", 0): Snippet(
        subs=(('"Wan2.1-T2V-14B-Diffusers"', '"{fixtures}/pipelines/wan_t2v"'),
              ("height=480, width=832, num_frames=81, num_inference_steps=50",
               "height=32, width=32, num_frames=5, num_inference_steps=2"),
              ('"corgi.mp4"', '"{tmp}/corgi.mp4"')),
        check="""
assert video.shape == (5, 32, 32, 3) and 0.0 <= video.min() and video.max() <= 1.0
assert (TMP / "corgi.mp4").stat().st_size > 0
"""),
    ("docs/video.md", 1): Snippet(
        # the tiny LTX-2 transformer has 2 blocks: STG on block 1 (diffusers' default block is 28)
        subs=(('"LTX-2"', '"{fixtures}/pipelines/ltx2"'),
              ("num_frames=121,", "num_frames=5, height=32, width=64, num_inference_steps=2, max_sequence_length=16,"
                                  " spatio_temporal_guidance_blocks=[1],"),
              ('"dog.mp4"', '"{tmp}/dog.mp4"'), ('"dog.wav"', '"{tmp}/dog.wav"')),
        check="""
want = np.asarray(out.audio[0], np.float32)
assert frames.shape == (5, 32, 64, 3) and fps == 24.0 and rate == pcm_rate == out.audio_sample_rate == 24000
assert wave.shape == pcm.shape == want.shape and np.abs(pcm - want.clip(-1, 1)).max() <= 0.5 / 32767 + 1e-7
"""),
    ("docs/models/qwen_image.md", 0): Snippet(
        subs=(("Qwen-Image/transformer", "{fixtures}/qwen_image/transformer"), ("(1, 64, 64)", "(1, 4, 6)")),
        preamble="""
kw, expected = read_fixture_io(FIXTURES / "qwen_image")
latents, prompt_embeds = kw["hidden_states"], kw["encoder_hidden_states"]
prompt_embeds_mask = kw["encoder_hidden_states_mask"]
t, batch = kw["timestep"] * 1000, len(kw["timestep"])
""",
        check="""
assert type(out).__name__ == "Transformer2DModelOutput"
assert rel_l2(sample, expected["sample"]) < 0.05, rel_l2(sample, expected["sample"])
"""),
}

# Docs whose snippets need a process of their own set up differently: multi-host's
# `distributed.initialize` must come before jax creates its backends.
NO_CPU_SETUP = {"docs/multi-host.md"}


def entry(block: Block, index: int) -> Snippet:
    """The block's table entry (none: it runs as printed), checked against the block."""
    snip = SNIPPETS.get((block.doc, index), Snippet())
    for old, _ in snip.subs:
        if old not in block.code:
            raise AssertionError(f"{block.doc}:{block.line} (python block {index}): the substitution "
                                 f"{old!r} of tests/test_docs.py SNIPPETS is not in the block any more")
    return snip


# --------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------

def test_every_fence_names_its_language():
    untagged = [f"{b.doc}:{b.line - 1}" for p in doc_files() for b in blocks(p) if not b.lang]
    assert not untagged, (f"fences without a language (```python runs in tests/test_docs.py; "
                          f"```bash or ```text otherwise): {untagged}")


def test_the_table_matches_the_docs():
    for (doc, index), snip in SNIPPETS.items():
        found = python_blocks(doc)
        assert index < len(found), f"SNIPPETS names {doc} python block {index}; it has {len(found)}"
        entry(found[index], index)
    assert NO_CPU_SETUP <= {doc for doc, _ in SNIPPETS}


DOCS_WITH_SNIPPETS = [p.relative_to(ROOT).as_posix() for p in doc_files()
                      if any(b.lang == "python" for b in blocks(p))]


@pytest.mark.parametrize("doc", DOCS_WITH_SNIPPETS)
def test_snippets_run(doc, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIFFLET_TPU_")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_backend_optimization_level=0")
    env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    try:
        proc = subprocess.run([sys.executable, __file__, doc, str(tmp_path)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{doc}: the snippets did not finish in {e.timeout} s")
    assert proc.returncode == 0, f"{doc}: a snippet failed\n{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    ran = proc.stdout.count("ran ")
    assert ran == len(python_blocks(doc)), proc.stdout


# --------------------------------------------------------------------------
# The subprocess: python tests/test_docs.py DOC TMP
# --------------------------------------------------------------------------

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_doc(doc: str, tmp: pathlib.Path) -> None:
    if doc not in NO_CPU_SETUP:
        from difflet_tpu import use_cpu_devices

        use_cpu_devices(4)
    import numpy as np

    from difflet_tpu.testing import read_fixture_io, rel_l2

    for index, block in enumerate(python_blocks(doc)):
        snip = entry(block, index)
        where = tmp / f"block{index}"
        where.mkdir()
        fill = dict(fixtures=FIXTURES.as_posix(), tmp=where.as_posix(), port=_free_port())
        helpers = dict(FIXTURES=FIXTURES, TMP=where, np=np, read_fixture_io=read_fixture_io, rel_l2=rel_l2)
        given = dict(helpers)
        exec(compile(snip.preamble, f"<preamble of {doc} block {index}>", "exec"), given)
        ns = {"__name__": "__main__"}
        ns.update({k: v for k, v in given.items() if k not in helpers and not k.startswith("__")})
        code = block.code
        for old, new in snip.subs:
            code = code.replace(old, new.format(**fill))
        # padded so that a traceback's line is the doc's line
        exec(compile("\n" * (block.line - 1) + code, block.doc, "exec"), ns)
        ns.update(helpers)
        exec(compile(snip.check, f"<check of {doc} block {index}>", "exec"), ns)
        print(f"ran {doc}:{block.line}", flush=True)


if __name__ == "__main__":
    try:
        run_doc(sys.argv[1], pathlib.Path(sys.argv[2]))
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
