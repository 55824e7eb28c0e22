"""The persistent compilation cache: `--compile-cache DIR` / DIFFLET_TPU_COMPILE_CACHE.

Two bench processes share one cache directory on CPU: the first compiles and
writes every program, the second loads all of them and writes nothing. Both
compile times land in the JSON; nothing here asserts on time.
"""

import json
import os
import subprocess
import sys

import pytest

from difflet_tpu import runtime
from difflet_tpu.bench import cli
from difflet_tpu.config import Config, ConfigError


def _bench(cache, out, env_cache=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DIFFLET_TPU_", "TPU_"))}
    argv = [sys.executable, "-m", "difflet_tpu.bench", "--model", "flux:tiny", "--mode", "sp", "--steps", "1",
            "--json", str(out)]
    if cache is not None:
        argv += ["--compile-cache", str(cache)]
    if env_cache is not None:
        env["DIFFLET_TPU_COMPILE_CACHE"] = str(env_cache)
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    (row,) = data["results"]
    assert "error" not in row, row
    return data, row


def test_a_second_process_loads_every_compiled_program(tmp_path):
    cache = tmp_path / "cache" / "nested"  # created by the bench
    first, r1 = _bench(None, tmp_path / "first.json", env_cache=cache)  # DIFFLET_TPU_COMPILE_CACHE
    s1 = r1["xla_compile"]
    assert first["compile_cache"]["dir"] == str(cache)
    assert first["compile_cache"]["entries_before"] == 0
    written = first["compile_cache"]["entries_after"]
    assert written > 0 and written == runtime.cache_entries(str(cache))
    assert s1["cache_hits"] == 0
    assert s1["cache_misses"] == written == s1["compiles"] == s1["cache_requests"]
    assert r1["compilations_warmup"] > 0

    # --compile-cache, while DIFFLET_TPU_COMPILE_CACHE names another directory: the flag wins
    second, r2 = _bench(cache, tmp_path / "second.json", env_cache=tmp_path / "unused")
    s2 = r2["xla_compile"]
    assert not (tmp_path / "unused").exists()
    assert second["compile_cache"]["entries_before"] == second["compile_cache"]["entries_after"] == written
    assert s2["cache_misses"] == 0, "the second run compiled and wrote new entries"
    assert s2["cache_hits"] == s2["compiles"] >= written  # every program, the steps included
    assert s2["cache_hits"] >= r2["compilations_warmup"] > 0
    assert r2["sha256"] == r1["sha256"]  # the loaded executables compute the same latents
    # recorded for the reader, not asserted: compile seconds without and with the cache
    print(f"compile s: first {s1['compile_s']} (warm-up {r1['compile_s']:.2f}), "
          f"second {s2['compile_s']} (warm-up {r2['compile_s']:.2f})")


def test_unusable_directories_are_clear_errors_before_any_work(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(runtime.CompileCacheError, match="cannot create the directory"):
        runtime.enable_compile_cache(str(a_file / "sub"))
    if os.geteuid() == 0:  # root writes through permission bits; /proc refuses new files
        read_only = "/proc"
    else:
        read_only = tmp_path / "ro"
        read_only.mkdir(mode=0o500)
    with pytest.raises(runtime.CompileCacheError, match="not writable"):
        runtime.enable_compile_cache(str(read_only))
    for bad in ("", "gs://bucket/cache"):
        with pytest.raises(runtime.CompileCacheError):
            runtime.enable_compile_cache(bad)
    import jax

    assert jax.config.jax_compilation_cache_dir is None  # nothing was switched on


def test_bench_flag_errors(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    stats = runtime.compile_stats()
    assert cli.main(["--model", "toy:tiny", "--compile-cache", str(a_file)]) == 2
    err = capsys.readouterr().err
    assert "compile cache" in err and str(a_file) in err
    assert runtime.stats_since(stats)["compiles"] == 0  # refused before anything compiled
    with pytest.raises(SystemExit):
        cli.main(["--compile-only", "--topology", "v5e:2x2", "--compile-cache", str(tmp_path)])
    assert "--compile-cache cannot be combined with --compile-only" in capsys.readouterr().err


def test_config_field():
    assert Config.from_env({}).compile_cache is None
    assert Config.from_env({}, compile_cache="/tmp/c").compile_cache == "/tmp/c"
    for bad in ("", "  ", "gs://b/c", 3):
        with pytest.raises(ConfigError, match="compile_cache"):
            Config(compile_cache=bad)
