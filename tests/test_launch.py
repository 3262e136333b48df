"""Issue 28.2, the launch line: a rewrite that starts several processes ends its summary with how
to run it (one node: python; several: torchrun per node, SLURM), ``--launcher slurm`` writes a
batch file in SLURM's documented format, and the 2-node launch line runs both "nodes" as
processes of this machine (gloo) and trains.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.launch import SBATCH_MARK, run_lines, sbatch_text
from accelerate_rewrite.options import Options
from accelerate_rewrite.verify.runner import GLOO_EXIT_ABORT
from tests.goldens import FIXTURES
from tests.processes import free_port


def _summary(tmp_path, *flags) -> str:
    shutil.copy(FIXTURES / "module_loop" / "input.py", tmp_path / "train.py")
    done = CliRunner().invoke(cli, [str(tmp_path / "train.py"), *flags], terminal_width=300)
    assert done.exit_code == 0, done.output
    return done.output


def test_one_node_says_python_starts_it(tmp_path):
    out = _summary(tmp_path, "--devices", "2")
    assert f"run it: python {tmp_path / 'train.py'} (fabric.launch() starts the 2 processes on this machine)" in out
    assert "run it" not in _summary(tmp_path, "--precision", "bf16-mixed")  # one process: nothing to say
    # with -o, the file written is the one to run
    assert f"run it: python {tmp_path / 'new.py'} " in _summary(tmp_path, "--devices", "2", "-o", str(tmp_path / "new.py"))


def test_several_nodes_get_a_command_per_node(tmp_path):
    out = _summary(tmp_path, "--devices", "4", "--num-nodes", "2")
    assert "run it on 2 nodes, 4 processes each: on every node, with R its rank (0 on the main node, 1 on the other)" in out
    assert (f"torchrun --nnodes=2 --nproc-per-node=4 --node-rank=R --master-addr=MAIN --master-port=29500 "
            f"{tmp_path / 'train.py'}") in out
    assert "--launcher slurm writes train.sbatch" in out
    assert "not `fabric run`" in out
    auto = run_lines("train.py", Options.create(num_nodes=3, strategy="ddp"))
    assert "--nproc-per-node=D" in auto[1] and "1..2 on the others" in auto[0]
    assert any("nodes x D is torchrun's world size" in line for line in auto)


#: sbatch's long options this file may use (sbatch(1)); a directive is "#SBATCH --name=value"
SBATCH_OPTIONS = {"job-name", "nodes", "ntasks-per-node", "gres", "mem", "time"}


def _directives(text: str) -> dict[str, str]:
    """The #SBATCH directives, read as sbatch reads them: from the top of the script until the
    first line that is neither blank nor a comment; any after that are ignored by sbatch."""
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    found: dict[str, str] = {}
    for line in lines[1:]:
        if line.strip() and not line.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            m = re.fullmatch(r"#SBATCH --([a-z-]+)=(\S+)", line)
            assert m, line
            found[m.group(1)] = m.group(2)
    later = [line for line in lines[lines.index(next(l for l in lines[1:] if l.strip() and not l.startswith("#"))):]
             if line.startswith("#SBATCH")]
    assert not later, f"directives after the first command are ignored by sbatch: {later}"
    return found


def test_the_batch_file_is_in_slurms_format():
    text = sbatch_text(Path("train.py"), Options.create(devices=4, num_nodes=2), ["--epochs", "3"])
    found = _directives(text)
    assert set(found) <= SBATCH_OPTIONS
    assert found["nodes"] == "2" and found["ntasks-per-node"] == "4" and found["gres"] == "gpu:4"
    assert re.fullmatch(r"\d+-\d{2}:\d{2}:\d{2}", found["time"])  # days-hours:minutes:seconds
    assert text.splitlines()[1] == SBATCH_MARK
    assert text.rstrip().splitlines()[-1] == "srun python train.py --epochs 3"
    cpu = _directives(sbatch_text(Path("train.py"), Options.create(devices=2, num_nodes=2, accelerator="cpu")))
    assert "gres" not in cpu and cpu["ntasks-per-node"] == "2"
    with pytest.raises(ValueError, match="needs a number of devices per node"):
        sbatch_text(Path("train.py"), Options.create(num_nodes=2, strategy="ddp"))


def test_launcher_slurm_writes_the_batch_file_only_when_writing(tmp_path):
    shutil.copy(FIXTURES / "module_loop" / "input.py", tmp_path / "train.py")
    flags = ["--devices", "4", "--num-nodes", "2", "--launcher", "slurm"]
    preview = CliRunner().invoke(cli, [str(tmp_path / "train.py"), *flags])
    assert preview.exit_code == 0 and "would write" in preview.output
    assert not (tmp_path / "train.sbatch").exists()
    written = CliRunner().invoke(cli, [str(tmp_path / "train.py"), *flags, "-o", str(tmp_path / "new.py")])
    assert written.exit_code == 0, written.output
    text = (tmp_path / "new.sbatch").read_text()
    assert "srun python new.py" in text and "#SBATCH --nodes=2" in text
    (tmp_path / "train.sbatch").write_text("#!/bin/bash\n#SBATCH --nodes=9\nsrun mine.sh\n")
    mine = CliRunner().invoke(cli, [str(tmp_path / "train.py"), *flags, "--write"])
    assert mine.exit_code == 0 and "was not written by accelerate-rewrite: left alone" in mine.output
    assert (tmp_path / "train.sbatch").read_text() == "#!/bin/bash\n#SBATCH --nodes=9\nsrun mine.sh\n"
    bad = CliRunner().invoke(cli, [str(tmp_path / "train.py"), "--num-nodes", "2", "--strategy", "ddp",
                                   "--launcher", "slurm", "--write"])
    assert bad.exit_code == 2 and "--devices N" in bad.output


@pytest.mark.runs
@pytest.mark.slow  # CI time: the launch lines are checked without a run above
def test_the_two_node_launch_line_trains(tmp_path):
    """Both "nodes" of a --num-nodes 2 rewrite as processes of this machine, started by the
    summary's own torchrun line (R and MAIN filled in), over gloo: both end, and rank 0 prints
    the losses."""
    pytest.importorskip("torch")
    pytest.importorskip("lightning")
    shutil.copy(FIXTURES / "module_loop" / "input.py", tmp_path / "train.py")
    options = Options.create(devices=1, num_nodes=2, accelerator="cpu")
    done = CliRunner().invoke(cli, [str(tmp_path / "train.py"), "--devices", "1", "--num-nodes", "2",
                                    "--accelerator", "cpu", "--write"])
    assert done.exit_code == 0, done.output
    [line] = [line for line in run_lines("train.py", options) if "torchrun" in line]
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    for _ in range(3):  # gloo's exit abort (tests/processes.py), a port taken meanwhile: the pair again
        procs = []
        for rank in (0, 1):
            cmd = shlex.split(line.replace("--node-rank=R", f"--node-rank={rank}")
                              .replace("MAIN", "127.0.0.1").replace("--master-port=29500", f"--master-port={port}"))
            assert cmd[0] == "torchrun"
            cmd = [sys.executable, "-m", "torch.distributed.run", *cmd[1:]]
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
        try:
            outs = [p.communicate(timeout=180)[0] for p in procs]
        except subprocess.TimeoutExpired:  # a node left waiting (its peer failed: a port taken since)
            for p in procs:
                p.kill()
            outs = [p.communicate()[0] for p in procs]
            codes = [p.returncode for p in procs]
            port = free_port()
            continue
        codes = [p.returncode for p in procs]
        if codes == [0, 0] or not any(GLOO_EXIT_ABORT in out or "EADDRINUSE" in out or "address already in use"
                                      in out.lower() for out in outs):
            break
        port = free_port()
    assert codes == [0, 0], outs
    assert re.search(r"epoch 0 step 0 loss \d", outs[0]), outs[0]
    assert "done" in outs[0]
