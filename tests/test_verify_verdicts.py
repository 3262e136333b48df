"""Issue 17, the verifier's verdicts: cheap checks (no training run, no subprocess that imports
torch). The runs that back them are in tests/test_verify.py and tests/test_verify_mutations.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from accelerate_rewrite.verify import session


def test_two_rewritten_files_of_one_script_never_collide(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('original')\n")
    with session._rewritten_file(script, "print('first')\n") as first:
        with session._rewritten_file(script, "print('second')\n") as second:
            assert first != second
            assert first.parent == second.parent == tmp_path  # beside the original: imports work
            assert first.read_text() == "print('first')\n"
            assert second.read_text() == "print('second')\n"
        assert not second.exists() and first.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_many_verifications_at_once_each_get_their_own_file(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    seen: list[tuple[Path, str]] = []
    barrier = threading.Barrier(8)

    def one(index: int) -> None:
        with session._rewritten_file(script, f"# run {index}\n") as path:
            barrier.wait(timeout=10)  # all files exist at once
            seen.append((path, path.read_text()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({path for path, _ in seen}) == 8
    assert sorted(text for _, text in seen) == sorted(f"# run {i}\n" for i in range(8))
    assert os.listdir(tmp_path) == ["train.py"]


def test_a_folder_that_cant_be_written_gets_a_temporary_one(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    real = session.tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):
        if Path(dir) == tmp_path:
            raise PermissionError(13, "Permission denied", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(session.tempfile, "mkstemp", read_only)
    with session._rewritten_file(script, "x = 1\n") as path:
        assert path.parent != tmp_path and path.read_text() == "x = 1\n"
        folder = path.parent
    assert not folder.exists()
