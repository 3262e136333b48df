"""The command line: preview, --write, -o, --check, errors, encodings, rules, explain.

The good script is fixtures/module_loop/input.py, which the default options rewrite. The
tests compare against what the engine itself produces, so they don't depend on the rules'
exact output or messages (only on rule codes).
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.codemod.files.diff import NO_NEWLINE, unified_diff
from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import PRECISIONS, STRATEGIES, Options
from accelerate_rewrite.rules import ALL_RULES

ROOT = Path(__file__).resolve().parent.parent
GOOD = ROOT / "fixtures" / "module_loop" / "input.py"
ANSI = re.compile(r"\x1b\[")
# rich looks at these; a CI that sets one must not change what the tests see
CLEAN_ENV = {"FORCE_COLOR": None, "NO_COLOR": None, "TTY_COMPATIBLE": None,
             "TTY_INTERACTIVE": None, "COLUMNS": None}


def expected_output(text: str, **options) -> str:
    return rewrite(text, Options.create(**options), path="x.py").output


@pytest.fixture
def run(tmp_path, monkeypatch):
    """Invoke the CLI in-process in tmp_path; returns click's Result (stdout/stderr apart)."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner(env=CLEAN_ENV)

    def invoke(*args, env=None):
        return runner.invoke(cli, [str(a) for a in args], env=env, catch_exceptions=False)

    return invoke


@pytest.fixture
def good(tmp_path) -> Path:
    path = tmp_path / "train.py"
    shutil.copyfile(GOOD, path)
    return path


def codes(text: str) -> set[str]:
    return set(re.findall(r"\bAR\d{3}\b", text))


# -- preview ---------------------------------------------------------------------------------


def test_preview_shows_the_diff_and_writes_nothing(run, good):
    before = good.read_bytes()
    result = run("train.py")
    assert result.exit_code == 0, result.output
    assert good.read_bytes() == before
    text = before.decode()
    assert result.stdout == unified_diff("train.py", text, expected_output(text))
    assert result.stdout.startswith("--- train.py\n+++ train.py\n@@ ")
    # the summary goes to stderr: rule codes with lines, and the final count
    assert {"AR101", "AR106"} <= codes(result.stderr)
    assert "train.py" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "1 file would be rewritten"
    assert not ANSI.search(result.stdout + result.stderr)


def test_diff_flag_and_options_before_the_path(run, good):
    result = run("--diff", "--precision", "bf16-mixed", "--devices", "4", "train.py")
    assert result.exit_code == 0, result.output
    text = good.read_text()
    expected = expected_output(text, precision="bf16-mixed", devices=4)
    assert result.stdout == unified_diff("train.py", text, expected)
    assert "bf16-mixed" in result.stdout


def test_explicit_rewrite_subcommand(run, good):
    result = run("rewrite", "train.py")
    assert result.exit_code == 0
    assert result.stdout.startswith("--- train.py")


def test_quiet_keeps_the_diff_and_drops_the_summary(run, good):
    result = run("train.py", "-q")
    assert result.exit_code == 0
    assert result.stdout.startswith("--- train.py")
    assert result.stderr == ""


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_piped_diff_applies_with_git(run, good, tmp_path):
    result = run("train.py")
    patch = tmp_path / "change.patch"
    patch.write_text(result.stdout)
    subprocess.run(["git", "apply", "-p0", str(patch)], cwd=tmp_path, check=True)
    text = GOOD.read_text()
    assert good.read_text() == expected_output(text)


# -- --write, -o, --check --------------------------------------------------------------------


def test_write_rewrites_in_place_and_is_idempotent(run, good):
    text = good.read_text()
    mode = stat.S_IMODE(good.stat().st_mode)
    result = run("train.py", "--write")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # no diff unless asked
    assert good.read_text() == expected_output(text)
    assert stat.S_IMODE(good.stat().st_mode) == mode
    assert "1 file rewritten" in result.stderr
    again = run("train.py", "--check")
    assert again.exit_code == 0, again.output
    assert "Would rewrite" not in again.output


def test_write_with_diff_shows_it(run, good):
    text = good.read_text()
    result = run("train.py", "--write", "--diff")
    assert result.exit_code == 0
    assert result.stdout == unified_diff("train.py", text, expected_output(text))


def test_output_file(run, good, tmp_path):
    before = good.read_bytes()
    result = run("train.py", "-o", "out.py")
    assert result.exit_code == 0, result.output
    assert good.read_bytes() == before
    assert (tmp_path / "out.py").read_text() == expected_output(before.decode())
    assert result.stdout == ""


def test_output_dash_is_stdout(run, good):
    result = run("train.py", "-o", "-")
    assert result.exit_code == 0
    assert result.stdout == expected_output(good.read_text())


@pytest.mark.parametrize("args", [
    ["train.py", "other.py", "-o", "out.py"],
    [".", "-o", "out.py"],
    ["train.py", "-o", "out.py", "--write"],
    ["train.py", "--check", "--write"],
    ["train.py", "--check", "-o", "out.py"],
])
def test_output_and_mode_conflicts(run, good, tmp_path, args):
    (tmp_path / "other.py").write_text("x = 1\n")
    before = good.read_bytes()
    result = run(*args)
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith("error: ")
    assert good.read_bytes() == before
    assert not (tmp_path / "out.py").exists()


def test_check_exit_codes(run, good, tmp_path):
    unchanged = tmp_path / "plain.py"
    unchanged.write_text("print('hello')\n")
    result = run("train.py", "--check")
    assert result.exit_code == 1
    assert "Would rewrite: train.py" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == "1 file would be rewritten"
    result = run("plain.py", "--check")
    assert result.exit_code == 0, result.output
    assert "Would rewrite" not in result.output
    result = run("plain.py", "missing.py", "--check")
    assert result.exit_code == 2
    # an error wins over "would change"
    result = run("train.py", "missing.py", "--check")
    assert result.exit_code == 2
    assert "Would rewrite: train.py" in result.stdout


def test_check_with_diff_keeps_stdout_a_patch(run, good):
    result = run("train.py", "--check", "--diff")
    assert result.exit_code == 1
    assert result.stdout.startswith("--- train.py")
    assert "Would rewrite" not in result.stdout
    assert "Would rewrite: train.py" in result.stderr


# -- options ---------------------------------------------------------------------------------


def test_invalid_precision_is_one_line_with_the_valid_values(run, good):
    result = run("train.py", "--precision", "fp8")
    assert result.exit_code == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "fp8" in lines[0]
    for value in PRECISIONS:
        assert value in lines[0]


@pytest.mark.parametrize("option, value, valid", [
    ("--strategy", "horovod", STRATEGIES[-1]),
    ("--devices", "zero", "auto"),
    ("--num-nodes", "0", ">= 1"),
    ("--accelerator", "npu", "mps"),
])
def test_other_invalid_options(run, good, option, value, valid):
    result = run("train.py", option, value)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and value in lines[0] and valid in lines[0]


def test_precision_alias(run, good):
    result = run("train.py", "--precision", "bf16")
    assert result.exit_code == 0
    assert "bf16-mixed" in result.stdout


# -- bad input -------------------------------------------------------------------------------


@pytest.fixture
def messy(tmp_path) -> Path:
    """A folder with a good script and three files that can't be rewritten."""
    folder = tmp_path / "proj"
    folder.mkdir()
    shutil.copyfile(GOOD, folder / "good.py")
    (folder / "broken.py").write_text("def train(:\n    pass\n")
    (folder / "x.py").write_bytes(b"\x00\x01\x02\xff binary\x00")
    (folder / "latin.py").write_bytes("# caf\xe9 cr\xe8me\nprint('ol\xe9')\n".encode("latin-1"))
    return folder


BAD = ("broken.py", "x.py", "latin.py")


def test_errors_name_each_file_and_the_rest_is_processed(run, messy):
    result = run("proj")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 3, result.stderr
    for name in BAD:
        assert sum(f"proj/{name}" in line for line in errors) == 1, (name, errors)
    assert "proj/broken.py:" in result.stderr  # the syntax error has a position
    assert "Traceback" not in result.output
    assert result.stdout.startswith("--- proj/good.py")  # the good file's diff
    assert result.stderr.strip().splitlines()[-1] == "1 file would be rewritten, 3 errors"


def test_errors_with_write_touch_nothing_but_the_good_file(run, messy):
    before = {name: (messy / name).read_bytes() for name in (*BAD, "good.py")}
    result = run("proj", "--write")
    assert result.exit_code == 2
    for name in BAD:
        assert (messy / name).read_bytes() == before[name]
    assert (messy / "good.py").read_text() == expected_output(before["good.py"].decode())
    assert sorted(p.name for p in messy.iterdir()) == sorted([*BAD, "good.py"])  # no temp files


def test_missing_path(run, good):
    result = run("nope.py", "train.py", "--write")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "nope.py" in errors[0]
    assert good.read_text() == expected_output(GOOD.read_text())  # still processed


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_a_one_line_error_never_a_hang(run, good, tmp_path):
    os.mkfifo(tmp_path / "pipe.py")  # reading it would block until a writer came
    result = run(str(tmp_path / "pipe.py"), "train.py", "--write")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "pipe.py: a FIFO, not a regular file: not read" in errors[0]
    assert good.read_text() == expected_output(GOOD.read_text())  # the others are still processed


def test_read_only_file_with_write(run, good):
    good.chmod(0o444)
    try:
        before = good.read_bytes()
        result = run("train.py", "--write")
        assert result.exit_code == 2
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "train.py" in errors[0]
        assert good.read_bytes() == before
    finally:
        good.chmod(0o644)


# -- encodings and line endings --------------------------------------------------------------


def test_crlf_kept_byte_for_byte(run, tmp_path):
    text = GOOD.read_text()
    path = tmp_path / "crlf.py"
    path.write_bytes(text.replace("\n", "\r\n").encode())
    result = run("crlf.py", "--write")
    assert result.exit_code == 0, result.output
    written = path.read_bytes()
    # the same rewrite as the LF file, with every line ending CRLF: nothing else moved
    assert written == expected_output(text).replace("\n", "\r\n").encode()
    assert b"\n" not in written.replace(b"\r\n", b"")


def test_crlf_diff_applies(run, tmp_path):
    text = GOOD.read_text()
    path = tmp_path / "crlf.py"
    path.write_bytes(text.replace("\n", "\r\n").encode())
    result = run("crlf.py")
    assert result.exit_code == 0
    # (click's Result.stdout turns CRLF into LF: look at the bytes)
    patch = result.stdout_bytes
    assert patch.startswith(b"--- crlf.py\n+++ crlf.py\n@@ ")
    assert b"\r\n" in patch
    if shutil.which("git"):
        (tmp_path / "p.patch").write_bytes(patch)
        subprocess.run(["git", "apply", "-p0", "p.patch"], cwd=tmp_path, check=True)
        assert path.read_bytes() == expected_output(text).replace("\n", "\r\n").encode()


def test_utf8_bom_kept(run, tmp_path):
    text = "# Überblick: ein Trainingsskript\n" + GOOD.read_text()
    path = tmp_path / "bom.py"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    result = run("bom.py", "--write")
    assert result.exit_code == 0, result.output
    assert path.read_bytes() == b"\xef\xbb\xbf" + expected_output(text).encode()


def test_latin1_with_cookie_kept(run, tmp_path):
    text = "# -*- coding: latin-1 -*-\n# Données synthétiques\n" + GOOD.read_text()
    path = tmp_path / "latin.py"
    path.write_bytes(text.encode("latin-1"))
    result = run("latin.py", "--write")
    assert result.exit_code == 0, result.output
    assert path.read_bytes() == expected_output(text).encode("latin-1")


# -- folders ---------------------------------------------------------------------------------


def test_folder_recursion_sorted_and_skipping(run, tmp_path):
    root = tmp_path / "src"
    for rel in ("b.py", "a.py", "pkg/c.py", ".hidden/h.py", ".venv/v.py", "__pycache__/p.py",
                "node_modules/n.py", "build/bu.py", "dist/d.py", "pkg/.#lock.py", "notes.txt"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(GOOD, root / rel)
    result = run("src", "--check")
    assert result.exit_code == 1
    listed = [line.removeprefix("Would rewrite: ") for line in result.stdout.splitlines()]
    assert listed == ["src/a.py", "src/b.py", "src/pkg/c.py"]
    # a skipped folder given by name is searched; a file given twice runs once
    result = run("src/build", "src/build/bu.py", "--check")
    assert result.stdout.splitlines() == ["Would rewrite: src/build/bu.py"]


def test_gitignore_and_virtual_environments_are_left_out(run, tmp_path):
    """As ruff and black: what the repository's .gitignore files (and .ignore) ignore is not
    searched, nor a virtual environment; a file named explicitly is read unless
    --force-exclude."""
    (tmp_path / ".git").mkdir()
    (tmp_path / ".gitignore").write_text("outputs/\n*_generated.py\n")
    for rel in ("src/train.py", "src/model_generated.py", "outputs/gen.py", "env/lib/x.py",
                "src/sub/keep.py", "src/sub/skip.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(GOOD, tmp_path / rel)
    (tmp_path / "env" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (tmp_path / "src" / "sub" / ".ignore").write_text("skip.py\n")
    listed = [line.removeprefix("Would rewrite: ") for line in run(".", "--check").stdout.splitlines()]
    assert listed == ["src/train.py", "src/sub/keep.py"]
    # from a subfolder, the root's .gitignore still applies
    listed = [line.removeprefix("Would rewrite: ") for line in run("src", "--check").stdout.splitlines()]
    assert listed == ["src/train.py", "src/sub/keep.py"]
    named = run("outputs/gen.py", "src/train.py", "--check")
    assert named.stdout.splitlines() == ["Would rewrite: outputs/gen.py", "Would rewrite: src/train.py"]
    forced = run("outputs/gen.py", "src/train.py", "--check", "--force-exclude")
    assert forced.stdout.splitlines() == ["Would rewrite: src/train.py"]


def test_empty_folder(run, tmp_path):
    (tmp_path / "empty").mkdir()
    result = run("empty")
    assert result.exit_code == 0
    assert "No Python files" in result.stderr


# -- colour ----------------------------------------------------------------------------------


def test_colour_only_when_forced_and_never_with_no_color(run, good):
    coloured = run("train.py", env={"FORCE_COLOR": "1"})
    assert coloured.exit_code == 0
    assert ANSI.search(coloured.stdout)
    plain = run("train.py", env={"FORCE_COLOR": "1", "NO_COLOR": "1"})
    assert plain.exit_code == 0
    assert not ANSI.search(plain.stdout + plain.stderr)
    assert plain.stdout == unified_diff("train.py", good.read_text(), expected_output(good.read_text()))


# -- rules, explain, help --------------------------------------------------------------------


def test_rules_lists_every_rule(run):
    result = run("rules")
    assert result.exit_code == 0, result.output
    for rule in ALL_RULES:
        line = next(line for line in result.stdout.splitlines() if line.startswith(rule.code))
        assert rule.name in line and rule.kind.value in line
    assert not ANSI.search(result.stdout)


def test_explain_prints_documentation_and_example(run):
    rule = next(r for r in ALL_RULES if r.code == "AR106")
    result = run("explain", "AR106")
    assert result.exit_code == 0, result.output
    flat = " ".join(result.stdout.split())
    assert " ".join(rule.documentation().split()) in flat
    for example in rule.examples:
        for line in example.after.splitlines():
            if line.strip():
                assert line.strip() in result.stdout
    by_name = run("explain", rule.name)
    assert by_name.exit_code == 0 and by_name.stdout == result.stdout


def test_explain_shows_example_options(run):
    rule = next((r for r in ALL_RULES if any(e.options for e in r.examples)), None)
    if rule is None:
        pytest.skip("no rule example uses options")
    result = run("explain", rule.code.lower())
    assert result.exit_code == 0
    example = next(e for e in rule.examples if e.options)
    for key, value in example.options.items():
        assert f"--{key.replace('_', '-')} {value}" in result.stdout


def test_explain_unknown_rule(run):
    result = run("explain", "AR999")
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "AR999" in result.stderr and ALL_RULES[0].code in result.stderr


def test_help(run):
    result = run("--help")
    assert result.exit_code == 0
    for word in ("PATH", "--precision", "--write", "--check", "rules", "explain"):
        assert word in result.stdout
    assert run("rewrite", "--help").exit_code == 0
    assert run("explain", "--help").exit_code == 0


# -- diff text -------------------------------------------------------------------------------


def test_unified_diff_details():
    assert unified_diff("a.py", "x = 1\n", "x = 1\n") == ""
    no_newline = unified_diff("a.py", "x = 1", "x = 2")
    assert no_newline == f"--- a.py\n+++ a.py\n@@ -1 +1 @@\n-x = 1\n{NO_NEWLINE}+x = 2\n{NO_NEWLINE}"
    added = unified_diff("a.py", "x = 1", "x = 1\n")
    assert added.endswith(f"-x = 1\n{NO_NEWLINE}+x = 1\n")
    crlf = unified_diff("a.py", "a\r\nb\r\n", "a\r\nc\r\n")
    assert crlf == "--- a.py\n+++ a.py\n@@ -1,2 +1,2 @@\n a\r\n-b\r\n+c\r\n"
    # a form feed inside a line is not a line break for diff or patch
    ff = unified_diff("a.py", "x\x0c = 1\ny = 2\n", "x\x0c = 1\ny = 3\n")
    assert " x\x0c = 1\n" in ff and ff.count("\n@@") == 1


# -- real processes --------------------------------------------------------------------------


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_python_dash_m(tmp_path, good):
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate_rewrite", "train.py", "--precision", "bf16-mixed"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    text = good.read_text()
    assert proc.stdout == unified_diff("train.py", text, expected_output(text, precision="bf16-mixed"))
    assert {"AR101", "AR106"} <= codes(proc.stderr)
    assert not ANSI.search(proc.stdout + proc.stderr)
    assert good.read_text() == GOOD.read_text()


def test_the_console_script_exits_with_the_commands_status_its_output_whole(tmp_path, good):
    """``console`` (the console script, ``python -m``) ends the process without the interpreter's
    teardown: the command's status, every line of its output, the ``atexit`` functions run."""
    def console(*args: str, prelude: str = "") -> subprocess.CompletedProcess:
        program = f"{prelude}import sys\nfrom accelerate_rewrite.cli import console\nsys.argv[1:] = {list(args)!r}\nconsole()\n"
        return subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=_env(), capture_output=True,
                              text=True, timeout=120)

    check = console("train.py", "--check")
    assert check.returncode == 1 and "1 file would be rewritten" in check.stderr
    missing = console("missing.py")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    diff = console("train.py", "--precision", "bf16-mixed", prelude="import atexit\natexit.register(print, 'ATEXIT')\n")
    text = good.read_text()
    assert diff.returncode == 0
    assert diff.stdout == unified_diff("train.py", text, expected_output(text, precision="bf16-mixed")) + "ATEXIT\n"


def test_no_torch_or_lightning_imported(tmp_path, good):
    program = textwrap.dedent(f"""
        import sys
        from accelerate_rewrite.cli import main
        try:
            main([{str(good)!r}, "--check", "--precision", "bf16-mixed", "--devices", "4"])
        except SystemExit as exc:
            code = exc.code
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "lightning"))
        print("RESULT", code, heavy)
    """)
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert "RESULT 1 []" in proc.stdout, proc.stdout + proc.stderr


def test_help_imports_no_torch(tmp_path):
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "accelerate_rewrite", "--help"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert "Usage:" in proc.stdout
    assert not re.search(r"\b(torch|lightning)\b", proc.stderr)


def test_json_records_are_written_without_loading_rich(tmp_path):
    """``--format json`` (and ``-o -``) write to stdout as its console would, without making the
    console: rich's import is a tenth of the start of every run (report.py ``out_file``)."""
    script = tmp_path / "train.py"
    script.write_text("import torch\nmodel = torch.nn.Linear(2, 2)\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "for x in range(3):\n    loss = model(torch.randn(4, 2)).sum()\n"
                      "    loss.backward()\n    opt.step()\n")
    probe = (
        "import contextlib, io, json, sys\n"
        "from accelerate_rewrite.cli import main\n"
        f"sys.argv = ['accelerate-rewrite', {str(script)!r}, '--no-cache', '--format', 'json']\n"
        "out = io.StringIO()\n"
        "try:\n"
        "    with contextlib.redirect_stdout(out):\n"
        "        main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "record = json.loads(out.getvalue().splitlines()[0])\n"
        "assert record['changed'] and 'AR101' in record['rules'], record\n"
        "assert not any(name == 'rich' or name.startswith('rich.') for name in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
