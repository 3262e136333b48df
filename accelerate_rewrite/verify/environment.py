"""What a verification needs from the machine, checked before anything runs.

A rewrite for FSDP, DeepSpeed, Transformer Engine, Fabric's 16-mixed, a GPU accelerator or
bitsandbytes' 8-bit optimizers can't be verified on a machine that lacks what it needs: that is
"not verified: needs X" (exit 2) with what would verify it, never "the rewrite broke the script".
The machine is asked through the Python that will run the scripts (``--python``), with the
environment of the rewritten run (``CUDA_VISIBLE_DEVICES``): a small subprocess that imports
torch only when CUDA is in question.

A run that failed anyway with a message that says the machine can't do it (``FSDP is only
available on GPU``, ``No module named 'bitsandbytes'``) is classified the same way afterwards:
:func:`machine_failure`.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

from accelerate_rewrite.options import Options

CUDA = "CUDA"
#: what would verify each need, said after "not verified: needs X"
HOW = {
    CUDA: "run the verification on a machine with an NVIDIA GPU (CUDA)",
    "transformer_engine": "pip install transformer-engine on a machine with an NVIDIA GPU "
                          "(Hopper or newer for fp8)",
    "bitsandbytes": "pip install bitsandbytes",
    "deepspeed": "pip install deepspeed on a machine with an NVIDIA GPU",
    "torch_xla": "run on a TPU machine with torch_xla installed",
}


@dataclass(frozen=True)
class Need:
    """One thing the options need: ``what`` (CUDA, or a module's import name), for ``why``."""

    what: str
    why: str
    devices: int = 1  # CUDA: how many GPUs


@dataclass
class Machine:
    cuda_devices: int
    modules: dict[str, bool]
    cuda_bf16: bool = False  # the GPU does bf16 (Ampere or newer)


def needs(options: Options, run_on: Optional[str], run_devices: Optional[int], against: bool = False) -> list[Need]:
    """What the rewritten run needs, given where it is told to run. ``--run-on cpu`` substitutes
    ddp for FSDP and DeepSpeed (the session reports that as not verified): they need no CUDA
    there, only what the substitution can't replace. With ``--against`` the file's backend is
    its own (native 16-mixed runs on the CPU): Fabric's 16-mixed is judged by what ran."""
    out: list[Need] = []
    precision, strategy = options.precision or "", options.strategy or ""
    if against and precision == "16-mixed":
        precision = ""
    accelerator = options.accelerator or "auto"
    gpus = 1
    if isinstance(options.effective_devices, int) and options.effective_devices > 1:
        gpus = options.effective_devices
    if run_devices is not None:
        gpus = run_devices
    if precision.startswith("transformer-engine"):
        out.append(Need(CUDA, f"--precision {precision} (Transformer Engine runs on NVIDIA GPUs only)"))
        out.append(Need("transformer_engine", f"--precision {precision}"))
    if strategy.startswith("deepspeed"):
        out.append(Need("deepspeed", f"--strategy {strategy}"))
    if run_on != "cpu":
        if strategy.startswith(("fsdp", "deepspeed")):
            out.append(Need(CUDA, f"--strategy {strategy} (Fabric runs it on GPUs only)", gpus))
        if precision == "16-mixed" and options.fabric:
            out.append(Need(CUDA, "--precision 16-mixed with Fabric (on the CPU Fabric runs "
                                  "bf16-mixed instead)"))
        if accelerator in ("cuda", "gpu"):
            out.append(Need(CUDA, f"--accelerator {accelerator}", gpus))
        if run_on == "cuda":
            out.append(Need(CUDA, "--run-on cuda", gpus))
    elif precision == "16-mixed" and options.fabric:
        out.append(Need(CUDA, "--precision 16-mixed with Fabric (on the CPU Fabric runs bf16-mixed "
                              "instead: --run-on cpu can't verify it)"))
    if accelerator == "tpu" or strategy.startswith(("xla", "single_xla", "single_tpu")):
        out.append(Need("torch_xla", f"--strategy {strategy}" if strategy else f"--accelerator {accelerator}"))
    if options.optimizer_8bit:
        out.append(Need("bitsandbytes", "--optimizer-8bit"))
    return out


PROBE = """\
import importlib.util, json, sys
wanted = json.loads(sys.argv[1])
out = {"modules": {m: importlib.util.find_spec(m) is not None for m in wanted["modules"]}, "cuda": 0}
if wanted["cuda"]:
    try:
        import torch
        out["cuda"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        out["bf16"] = bool(out["cuda"] and torch.cuda.is_bf16_supported())
    except Exception:
        pass
print(json.dumps(out))
"""


def probe(python: str, wanted: Sequence[Need], env: Optional[dict] = None, cwd=None) -> Machine:
    """Ask the run's Python what it has: the modules ``wanted`` names, and CUDA devices (only
    when a need is CUDA: importing torch takes seconds)."""
    modules = sorted({n.what for n in wanted if n.what != CUDA})
    cuda = any(n.what == CUDA for n in wanted)
    if not modules and not cuda:
        return Machine(0, {})
    hidden = env is not None and env.get("CUDA_VISIBLE_DEVICES") == ""
    try:
        done = subprocess.run([python, "-c", PROBE, json.dumps({"modules": modules, "cuda": cuda and not hidden})],
                              capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
        data = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return Machine(0, {m: False for m in modules})  # the scripts' runs will say more
    return Machine(int(data.get("cuda") or 0), {m: bool(data["modules"].get(m)) for m in modules},
                   cuda_bf16=bool(data.get("bf16")))


def missing(wanted: Sequence[Need], machine: Machine) -> list[Need]:
    out = []
    for need in wanted:
        if need.what == CUDA:
            if machine.cuda_devices < need.devices:
                out.append(need)
        elif not machine.modules.get(need.what, False):
            out.append(need)
    return out


def describe(missing_needs: Sequence[Need], machine: Machine) -> str:
    """``needs CUDA (for --strategy fsdp ...), transformer_engine (...)``, then what would verify it."""
    parts, hows = [], []
    for need in missing_needs:
        what = need.what
        if what == CUDA:
            have = ("no CUDA device" if machine.cuda_devices == 0
                    else f"{machine.cuda_devices} CUDA device(s)")
            what = f"{need.devices} CUDA devices" if need.devices > 1 else "CUDA"
            parts.append(f"{what} for {need.why}; this machine has {have}")
        else:
            parts.append(f"{what} (import {what}) for {need.why}; it is not installed for the run's Python")
        how = HOW.get(need.what)
        if how and how not in hows:
            hows.append(how)
    text = "needs " + "; ".join(parts)
    if hows:
        text += ". To verify it: " + "; ".join(hows)
    return text


#: a run's last error line that says the machine can't do what the script asks -> what it needs
_MACHINE_ERRORS = [
    (re.compile(r"FSDP is only available on GPU|DeepSpeed.*(GPU|CUDA)|requires a GPU"), CUDA),
    (re.compile(r"Torch not compiled with CUDA|Found no NVIDIA driver|CUDA is not available|"
                r"no CUDA GPUs are available|`?CUDAAccelerator`? can not run|No supported gpu backend"), CUDA),
    (re.compile(r"No module named '(transformer_engine|bitsandbytes|deepspeed|torch_xla)"), None),
    # oneDNN has no kernel for this layer at this precision on this CPU (an LSTM under CPU bf16
    # autocast, on a CPU without bfloat16 instructions): the fp32 original ran, so it is the machine
    (re.compile(r"could not create a primitive descriptor for the \w+ (forward|backward)"),
     "a CPU kernel for this layer at this precision (oneDNN has none on this CPU; a GPU, "
     "or a CPU with bfloat16 instructions, runs it)"),
]


def machine_failure(error: Optional[str]) -> Optional[str]:
    """What the machine lacks, if a run's error says so (its last line), else None."""
    if not error:
        return None
    last = error.rstrip().splitlines()[-1] if error.strip() else ""
    for pattern, what in _MACHINE_ERRORS:
        found = pattern.search(last)
        if found:
            return what or found.group(1)
    return None
