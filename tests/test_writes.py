"""Every file the project writes goes through one atomic writer (`checks.write_atomic`,
`checks.atomic_dir`): no partial file on error, and the mode `open()` / `os.makedirs` would
give (0666 / 0777 less the umask), not the temporary file's 0600 / 0700."""

import os
import stat

import numpy as np
import pytest

from difflet_tpu import checks
from difflet_tpu.check import report
from difflet_tpu.pipeline import images


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_files_get_the_mode_open_would_give(tmp_path, umask_022):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")  # the reference: what open() makes under this umask
    written = [checks.write_atomic(tmp_path / "a.json", "{}\n"), checks.write_atomic(tmp_path / "b.bin", b"\x00")]
    report.write(str(tmp_path / "r.md"), "# r\n")
    images.save_png(np.zeros((4, 4, 3), np.float32), tmp_path / "x.png")
    for p in [*written, tmp_path / "r.md", tmp_path / "x.png"]:
        assert _mode(p) == _mode(plain) == 0o644, p
    with checks.atomic_dir(tmp_path / "trace") as d:
        (open(os.path.join(d, "t.pb"), "w")).close()
    os.makedirs(tmp_path / "made")
    assert _mode(tmp_path / "trace") == _mode(tmp_path / "made") == 0o755


def test_a_failing_writer_leaves_nothing(tmp_path):
    target = tmp_path / "x.png"
    target.write_bytes(b"old")

    def broken(f):
        f.write(b"half")
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError, match="encoder failed"):
        checks.write_atomic(target, broken)
    assert target.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["x.png"]
    with pytest.raises(checks.WriteError, match="nothing was written"):
        checks.write_atomic(tmp_path / "no-such-dir" / "y.json", "{}")
