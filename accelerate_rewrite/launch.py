"""How to run a rewrite that starts several processes (issue 28.2): the lines the summary ends
with, and the SLURM batch file ``--launcher slurm`` writes.

- One node: ``python train.py``; ``fabric.launch()`` starts the processes on this machine.
- Several nodes: one command per node. torchrun's (``--nnodes``, ``--nproc-per-node``,
  ``--node-rank``, ``--master-addr``, ``--master-port``): Fabric reads the TorchElastic
  environment it sets, and ``fabric.launch()`` then starts nothing more. Not ``fabric run``: the
  rewritten script calls ``fabric.launch()``, which Fabric refuses under its own command line
  ("This script was launched through the CLI, and processes have already been created").
  Fabric checks that torchrun's world size is ``num_nodes * devices``, so a mismatch fails at
  start-up, loudly.
- SLURM: ``sbatch train.sbatch``, one task per device (``--ntasks-per-node`` = devices), ``srun
  python train.py``: Fabric reads SLURM's environment (lightning's SLURMEnvironment), as its
  documentation's multi-node SLURM guide shows.
- ``--backend accelerate``: ``accelerate launch --multi_gpu --num_processes N train.py`` on one
  node (measured, accelerate 1.15: without ``--multi_gpu`` on a machine with no GPU its simple
  launcher starts one process; with it, torch's elastic launcher starts N, and
  ``Accelerator(cpu=True)``, which ``--accelerator cpu`` writes, runs them as N CPU processes); on
  several, one ``accelerate launch --multi_gpu --num_machines M --num_processes M*N
  --machine_rank R --main_process_ip MAIN --main_process_port P`` per node (its
  ``--num_processes`` counts every machine's; ``--multi_gpu``, since one GPU per node would
  otherwise take its simple launcher), or torchrun's line, whose environment ``Accelerator()``
  reads; on SLURM one task per node that runs that command with SLURM's node rank (the layout
  of Accelerate's examples/slurm/submit_multinode.sh).
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional, Sequence

from accelerate_rewrite.options import Options

MAIN_PORT = 29500
#: the first line of a batch file this tool wrote: only such a file is written over
SBATCH_MARK = "# written by accelerate-rewrite --launcher slurm"


def launches(result, options: Options) -> bool:
    """The rewrite created and launched a Fabric that starts several processes."""
    return options.fabric and options.many_devices and any(n.rule == "AR101" for n in result.changes)


def _devices(options: Options) -> Optional[int]:
    devices = options.effective_devices
    return devices if isinstance(devices, int) and devices > 0 else None


def run_lines(script: str, options: Options) -> list[str]:
    """What the summary says after a rewrite that launches several processes."""
    nodes = options.num_nodes or 1
    devices = _devices(options)
    per_node = f"{devices} processes" if devices else "one process per device"
    name = shlex.quote(script)
    if options.accelerate and nodes == 1:  # Accelerate's launcher starts the processes
        n = devices if devices else "N"
        return [f"run it: accelerate launch --multi_gpu --num_processes {n} {name} (or torchrun "
                f"--nproc-per-node={n} {name}; `python {name}` runs one process)"]
    if nodes == 1:
        return [f"run it: python {name} (fabric.launch() starts the {per_node} on this machine)"]
    d = devices if devices else "D"
    others = "1 on the other" if nodes == 2 else f"1..{nodes - 1} on the others"
    how = ("srun runs accelerate launch once on each node" if options.accelerate
           else "srun starts one task per device on each node")
    lines = [
        f"run it on {nodes} nodes, {per_node} each: on every node, with R its rank (0 on the main node, "
        f"{others}) and MAIN the main node's address (reachable from the others):",
        f"  torchrun --nnodes={nodes} --nproc-per-node={d} --node-rank=R --master-addr=MAIN "
        f"--master-port={MAIN_PORT} {name}",
        f"  on SLURM: --launcher slurm writes {shlex.quote(str(sbatch_path(Path(script)).name))} (sbatch it; {how})",
    ]
    if options.accelerate:
        if (options.accelerator or "auto") != "cpu":
            total = nodes * devices if devices else f"{nodes}xD"
            lines.insert(1, f"  accelerate launch --multi_gpu --num_machines {nodes} --num_processes {total} "
                            f"--machine_rank R --main_process_ip MAIN --main_process_port {MAIN_PORT} {name}")
            lines[2] = "  or " + lines[2].lstrip()
        return lines
    lines.append("  not `fabric run`: Fabric refuses fabric.launch() under its own command line")
    if not devices:
        lines.insert(2, "  (D: the devices of each node; Fabric checks that nodes x D is torchrun's world size)")
    return lines


def sbatch_path(script: Path) -> Path:
    return script.with_suffix(".sbatch")


def sbatch_text(script: Path, options: Options, script_args: Sequence[str] = ()) -> str:
    """A batch file for Fabric on SLURM (the layout of Lightning's multi-node SLURM guide):
    nodes, one task per device on each, the GPUs asked for where the accelerator is a GPU's."""
    devices = _devices(options)
    if devices is None:
        raise ValueError("--launcher slurm needs a number of devices per node (--devices N): "
                         "SLURM's --ntasks-per-node is one task per device")
    if options.accelerate:
        return _accelerate_sbatch(script, options, devices, script_args)
    accelerator = options.accelerator or "auto"
    lines = [
        "#!/bin/bash",
        SBATCH_MARK,
        f"#SBATCH --job-name={script.stem}",
        f"#SBATCH --nodes={options.num_nodes or 1}",
        f"#SBATCH --ntasks-per-node={devices}",
    ]
    if accelerator in ("auto", "gpu", "cuda"):
        lines.append(f"#SBATCH --gres=gpu:{devices}")
    lines += [
        "#SBATCH --mem=0",
        "#SBATCH --time=0-02:00:00",
        "",
        "# activate the environment the script runs in here (conda activate ..., source .venv/bin/activate)",
        "",
        "# one task per device on each node; Fabric reads SLURM's environment (ranks, main address)",
        "srun " + shlex.join(["python", script.name, *script_args]),
        "",
    ]
    return "\n".join(lines)


def _accelerate_sbatch(script: Path, options: Options, devices: int, script_args: Sequence[str]) -> str:
    """``--backend accelerate``: one task per node, each an ``accelerate launch`` of that node's
    processes, with SLURM's node rank and the first node's address (Accelerate's
    examples/slurm/submit_multinode.sh)."""
    nodes = options.num_nodes or 1
    gpu = (options.accelerator or "auto") in ("auto", "gpu", "cuda")
    lines = [
        "#!/bin/bash",
        SBATCH_MARK,
        f"#SBATCH --job-name={script.stem}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpu:
        lines.append(f"#SBATCH --gres=gpu:{devices}")
    if gpu:
        launch = ["accelerate", "launch", "--multi_gpu", "--num_machines", "$SLURM_NNODES",
                  "--num_processes", f"$(({devices} * SLURM_NNODES))", "--machine_rank", "$SLURM_NODEID",
                  "--main_process_ip", "$MAIN_PROCESS_IP", "--main_process_port", str(MAIN_PORT)]
    else:  # CPU processes: torchrun's environment, which Accelerator() reads as accelerate launch's
        launch = ["torchrun", "--nnodes", "$SLURM_NNODES", f"--nproc-per-node={devices}", "--node-rank",
                  "$SLURM_NODEID", "--master-addr", "$MAIN_PROCESS_IP", f"--master-port={MAIN_PORT}"]
    launch += [script.name, *(shlex.quote(a) for a in script_args)]
    lines += [
        "#SBATCH --mem=0",
        "#SBATCH --time=0-02:00:00",
        "",
        "# activate the environment the script runs in here (conda activate ..., source .venv/bin/activate)",
        "",
        "export MAIN_PROCESS_IP=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        f"# one task per node: {launch[0]} starts its {devices} processes; Accelerator() reads their ranks",
        "srun bash -c " + shlex.quote(" ".join(launch)),  # each node's own $SLURM_NODEID
        "",
    ]
    return "\n".join(lines)
