"""The cache of results (accelerate_rewrite/cache.py): a hit gives what the rewrite gives,
without rewriting; a change of the file, an option, the configuration or an imported module of
the project is a miss; a corrupt entry is never trusted; --no-cache and a cache folder that
can't be written change nothing of what the user sees.

Each test points the cache at its own folder (tests/conftest.py sends the rest of the suite's to
a throwaway one). A hit is told from a miss by the rewrite not being called at all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

import accelerate_rewrite.prepare as runner_module
from accelerate_rewrite import cache, config
from accelerate_rewrite.cli import cli

ROOT = Path(__file__).resolve().parent.parent
GOOD = ROOT / "fixtures" / "module_loop" / "input.py"
#: fixtures/module_loop with a torch.cuda.amp call for the pre-commit hook to fix
OLD_AMP = "import torch\nscaler = torch.cuda.amp.GradScaler()\nloss = model(x)\nloss.backward()\n"


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(cache.ENV_DIR, str(folder))
    monkeypatch.delenv(cache.ENV_OFF, raising=False)
    return folder


@pytest.fixture
def rewrites(monkeypatch) -> list[str]:
    """The files the runner rewrote (not answered from the cache), in order."""
    calls: list[str] = []
    real = runner_module.rewrite_text

    def counted(text, path, *args, **kwargs):
        calls.append(Path(path).name)
        return real(text, path, *args, **kwargs)

    monkeypatch.setattr(runner_module, "rewrite_text", counted)
    return calls


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner(env={"NO_COLOR": "1", "FORCE_COLOR": None, "COLUMNS": None})

    def invoke(*args, env=None):
        config.load.cache_clear()  # each run reads the configuration anew, as a new process does
        config._find.cache_clear()
        result = runner.invoke(cli, [str(a) for a in args], env=env, catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    return invoke


@pytest.fixture
def good(tmp_path) -> Path:
    path = tmp_path / "train.py"
    shutil.copyfile(GOOD, path)
    return path


def entries(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/*.json")) if folder.is_dir() else []


@pytest.mark.parametrize("args", [
    [],  # the diff and the notes
    ["--check"],
    ["--format", "json"],
    ["--precision", "bf16-mixed", "--devices", "2"],
    ["--pre-commit", "--isolated"],  # nothing to fix in module_loop: left unchanged
], ids=["preview", "check", "json", "bf16-devices", "pre-commit"])
def test_a_hit_says_what_the_rewrite_says_without_rewriting(run, good, cache_dir, rewrites, args):
    first = run("train.py", *args)
    assert rewrites == ["train.py"]
    assert len(entries(cache_dir)) == 1
    second = run("train.py", *args)
    assert rewrites == ["train.py"]  # not rewritten again
    assert second == first
    assert good.read_bytes() == GOOD.read_bytes()


def test_a_hit_with_notes_left_alone_and_numerics_is_the_same(run, tmp_path, cache_dir, rewrites):
    (tmp_path / "t.py").write_bytes((ROOT / "fixtures" / "train_function" / "input.py").read_bytes())
    first = run("t.py", "--precision", "bf16-mixed", "--devices", "4", "--diff")
    second = run("t.py", "--precision", "bf16-mixed", "--devices", "4", "--diff")
    assert rewrites == ["t.py"]
    assert second == first
    assert "numerics:" in first[2] and "AR101" in first[2]


def test_a_changed_file_another_option_or_configuration_is_a_miss(run, good, tmp_path, cache_dir, rewrites):
    run("train.py", "--check")
    good.write_text(good.read_text() + "\n# a comment\n")
    run("train.py", "--check")
    run("train.py", "--check", "--precision", "bf16-mixed")
    run("train.py", "--check", "--select", "AR1")
    assert len(rewrites) == 4
    (tmp_path / "pyproject.toml").write_text('[tool.accelerate-rewrite]\nprecision = "bf16-mixed"\n')
    run("train.py", "--check")  # the configuration gives what the flag gave: same values
    assert len(rewrites) == 4
    (tmp_path / "pyproject.toml").write_text('[tool.accelerate-rewrite]\nprecision = "16-mixed"\n')
    code, _, _ = run("train.py", "--check")
    assert len(rewrites) == 5 and code == 1
    run("train.py", "--check", "--isolated")  # the configuration left out: the first run's values
    assert len(rewrites) == 5


def test_an_edit_of_a_module_the_script_imports_is_a_miss(run, tmp_path, cache_dir, rewrites):
    """The rewrite reads data.py (its make_loaders returns DataLoaders, so the loaders are set
    up); when data.py changes, so may the result."""
    (tmp_path / "data.py").write_text(textwrap.dedent("""\
        import torch
        from torch.utils.data import DataLoader, TensorDataset


        def make_loaders():
            return DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2, shuffle=True)
        """))
    (tmp_path / "train.py").write_text(textwrap.dedent("""\
        import torch
        from data import make_loaders


        def main():
            device = "cuda" if torch.cuda.is_available() else "cpu"
            train_loader = make_loaders()
            model = torch.nn.Linear(4, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for (x,) in train_loader:
                loss = model(x.to(device)).sum()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        """))
    assert run("train.py", "--check", "--devices", "2")[0] == 1
    (tmp_path / "notes.py").write_text("x = 1\n")  # not imported: still a hit
    assert run("train.py", "--check", "--devices", "2")[0] == 1
    assert rewrites == ["train.py"]
    (tmp_path / "data.py").write_text(
        "import torch\n\n\ndef make_loaders():\n    return torch.randn(8, 4)\n")
    second = run("train.py", "--check", "--devices", "2")
    assert rewrites == ["train.py", "train.py"]
    assert second == run("train.py", "--check", "--devices", "2", "--no-cache")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "body-edited", "checksum-kept-types-wrong",
                                    "empty"])
def test_a_corrupt_entry_is_ignored_and_replaced(run, good, cache_dir, rewrites, damage):
    first = run("train.py")
    [entry] = entries(cache_dir)
    data = entry.read_bytes()
    head, _, body = data.partition(b"\n")
    if damage == "garbage":
        entry.write_bytes(b"\x00\xff not an entry")
    elif damage == "truncated":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "body-edited":  # a note's line moved, the checksum no longer matches
        entry.write_bytes(head + b"\n" + body.replace(b'",', b'" ,', 1))
    elif damage == "checksum-kept-types-wrong":  # a valid entry by its checksum, with a bad field
        record = json.loads(body)
        record["notes"] = [["AR101", "one", "x", False, None]]
        body = json.dumps(record).encode()
        import hashlib

        entry.write_bytes(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    else:
        entry.write_bytes(b"")
    second = run("train.py")
    assert rewrites == ["train.py", "train.py"]
    assert second == first
    assert run("train.py") == first and len(rewrites) == 2  # the entry was written anew


def test_no_cache_reads_and_writes_nothing(run, good, cache_dir, rewrites):
    first = run("train.py", "--check", "--no-cache")
    assert not cache_dir.exists()
    run("train.py", "--check")
    assert len(entries(cache_dir)) == 1
    assert run("train.py", "--check", "--no-cache") == first
    assert run("train.py", "--check", env={cache.ENV_OFF: "1"}) == first
    assert rewrites == ["train.py"] * 4


def test_the_cache_dir_option_wins_over_the_environment(run, good, tmp_path, cache_dir, rewrites):
    run("train.py", "--check", "--cache-dir", tmp_path / "other")
    assert len(entries(tmp_path / "other")) == 1 and not cache_dir.exists()
    assert (tmp_path / "other" / "CACHEDIR.TAG").is_file()  # backup tools and git leave it out
    assert (tmp_path / "other" / ".gitignore").read_text() == "*\n"


def test_a_cache_folder_that_cant_be_written_is_skipped(run, good, tmp_path, cache_dir, rewrites, monkeypatch):
    first = run("train.py", "--check", "--no-cache")
    (tmp_path / "a-file").write_text("")
    # a cache folder under a file, and (root writes anywhere) one whose temporary files fail
    assert run("train.py", "--check", "--cache-dir", tmp_path / "a-file" / "cache") == first
    assert run("train.py", "--write", "--cache-dir", tmp_path / "a-file" / "cache")[0] == 0

    def no_temp(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    shutil.copyfile(GOOD, tmp_path / "train.py")
    monkeypatch.setattr(tempfile, "mkstemp", no_temp)
    assert run("train.py", "--check") == first
    assert entries(cache_dir) == []
    assert rewrites == ["train.py"] * 4


def test_write_rewrites_a_file_the_cache_has_as_changed(run, good, cache_dir, rewrites):
    run("train.py", "--check")
    code, _, err = run("train.py", "--write")
    assert code == 0 and "rewritten" in err
    assert good.read_text() != GOOD.read_text()
    assert rewrites == ["train.py", "train.py"]
    assert run("train.py", "--check")[0] == 0  # the new text: rewritten once, then a hit
    assert run("train.py", "--check")[0] == 0
    assert rewrites == ["train.py"] * 3


def test_errors_are_not_cached(run, tmp_path, cache_dir, rewrites):
    (tmp_path / "bad.py").write_text("import torch\ndef train(:\n    pass\n")
    first = run("bad.py", "--check")
    assert first[0] == 2 and run("bad.py", "--check") == first
    assert entries(cache_dir) == [] and rewrites == ["bad.py", "bad.py"]


def test_many_files_with_processes_hit_in_order(run, tmp_path, cache_dir, rewrites):
    for i in range(4):
        (tmp_path / f"t{i}.py").write_bytes(GOOD.read_bytes() + f"# {i}\n".encode())
    first = run(".", "--check", "-j", "2")  # rewritten in the pool's processes, which store
    assert len(entries(cache_dir)) == 4
    assert run(".", "--check", "-j", "1") == first
    assert rewrites == []  # every file answered from the cache, here
    assert run(".", "--check", "-j", "2") == first


def test_hits_and_misses_mixed_keep_the_order_of_the_files(run, tmp_path, cache_dir):
    for i in range(5):
        (tmp_path / f"t{i}.py").write_bytes(GOOD.read_bytes() + f"# {i}\n".encode())
    (tmp_path / "t2.py").write_text("import torch\ndef f(:\n")  # an error among them
    uncached = run(".", "--no-cache", "-j", "1")
    run("t1.py", "t3.py")  # two of them in the cache
    assert len(entries(cache_dir)) == 2
    assert run(".", "-j", "2") == uncached
    assert len(entries(cache_dir)) == 4
    assert run(".", "-j", "2") == uncached


def test_a_hit_loads_neither_libcst_nor_the_rules(good, cache_dir):
    """What the cache answers needs no parse: neither libcst nor the rules are imported (nor
    rich, when nothing is printed)."""
    code = textwrap.dedent("""\
        import sys
        from pathlib import Path
        from accelerate_rewrite import cache
        from accelerate_rewrite.codemod.files.paths import Target
        from accelerate_rewrite.options import Options
        from accelerate_rewrite.settings import Mode, Settings

        settings = Settings(mode=Mode.CHECK, options=Options(), isolated=True, cache_dir=Path(sys.argv[1]))
        prepared = cache.prepare(Target(Path("train.py")), settings)
        loaded = {m.split(".")[0] for m in sys.modules} & {"libcst", "rich"}
        print(prepared.result.changed, sorted(loaded), "accelerate_rewrite.rules" in sys.modules)
        """)
    args = [sys.executable, "-c", code, str(cache_dir)]
    first = subprocess.run(args, cwd=good.parent, capture_output=True, text=True, check=True)
    assert first.stdout.split() == ["True", "['libcst']", "True"]
    again = subprocess.run(args, cwd=good.parent, capture_output=True, text=True, check=True)
    assert again.stdout.split() == ["True", "[]", "False"]
    # the whole command: the pre-commit hook on a script with nothing to fix, which it says nothing of
    code = ("import sys\nfrom accelerate_rewrite.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as exc:\n    code = exc.code\n"
            "loaded = {m.split('.')[0] for m in sys.modules} & {'libcst', 'rich'}\n"
            "print(code, sorted(loaded), 'accelerate_rewrite.rules' in sys.modules)")
    args = [sys.executable, "-c", code, "train.py", "--pre-commit", "--isolated", "--cache-dir", str(cache_dir)]
    subprocess.run(args, cwd=good.parent, capture_output=True, text=True, check=True)
    again = subprocess.run(args, cwd=good.parent, capture_output=True, text=True, check=True)
    assert again.stdout.split() == ["0", "[]", "False"], again.stderr


def test_the_default_folder_follows_the_platform(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache.default_dir() == tmp_path / "accelerate-rewrite"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as the spec says
    assert cache.default_dir() == Path.home() / ".cache" / "accelerate-rewrite"
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cache.default_dir() == Path.home() / "Library" / "Caches" / "accelerate-rewrite"
    assert cache.chosen_dir(True, str(tmp_path)) is None
    assert cache.chosen_dir(False, "~/x") == Path.home() / "x"
