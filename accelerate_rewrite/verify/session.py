"""One verification: rewrite (or take ``--against``), run both, compare.

    verify(Path("train.py"), Options.create(precision="bf16-mixed"), script_args=["--epochs", "1"])
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from accelerate_rewrite.options import Options
from accelerate_rewrite.verify import environment, shards
from accelerate_rewrite.verify.compare import (
    APPROXIMATE,
    CHANGES_TRAINING,
    EXACT,
    FAIL,
    NOT_COMPARED,
    NOT_VERIFIED,
    PASS,
    Claims,
    Tolerance,
    Verdict,
    compare,
    last_line,
    noise_floor,
)
from accelerate_rewrite.verify.evidence import HALF
from accelerate_rewrite.verify.runner import RunRecord, ending_runs_on_signals, run_script, torchrun


class VerifyError(Exception):
    """The verification could not start (no such script, the rewrite failed, ...)."""


@dataclass
class Verification:
    script: Path
    options: Options
    verdict: Verdict
    original: RunRecord
    rewritten: RunRecord
    against: Optional[Path] = None
    notes: list[str] = field(default_factory=list)  # what the verifier did to run things
    #: the structure run (the rewrite with its precision switched off), where there was one
    structure: Optional[RunRecord] = None
    #: several processes: the original run on their batches joined, which the verdict compared
    joined: Optional[RunRecord] = None

    @property
    def reference(self) -> RunRecord:
        """The run the rewritten one was compared with, step by step."""
        return self.joined or self.original

    def to_json(self) -> dict:
        runs = {}
        for key, run in (("original", self.original), ("rewritten", self.rewritten), ("joined", self.joined)):
            if run is None:
                continue
            runs[key] = run.to_json()
            # per step, each parameter group's and top-level module's gradient norm and update size
            runs[key]["where"] = run.where
        return {
            "verdict": self.verdict.verdict,
            "reason": self.verdict.reason,
            "original": runs["original"],
            "rewritten": runs["rewritten"],
            "comparison": self.verdict.comparison,
            "notes": self.notes,
        }


def tolerance_kind(options: Options, rule_kinds: Sequence[str], processes: int) -> str:
    if processes > 1 or "changes-training" in rule_kinds or claims_for(options, (), processes).unchecked_or_checked:
        return CHANGES_TRAINING
    if options.mixed_or_low_precision or "approximate" in rule_kinds or _approximate_options(options):
        return APPROXIMATE
    return EXACT


def _approximate_options(options: Options) -> bool:
    """Options whose rewrite changes the numerics within a tolerance (whatever the rules say: with
    --against nothing is rewritten, and the options alone classify the run)."""
    return bool(options.optimizer_8bit or options.compile or options.dynamic_padding
                or (options.accumulate and options.keep_effective_batch))


#: rules whose change of training an option explains (and a check or a phrase of its own covers)
_OPTION_RULES = {"AR301", "AR302", "AR303", "AR503"}


class _Claims(Claims):
    @property
    def unchecked_or_checked(self) -> bool:
        return bool(self.freeze or self.clip_grad_norm is not None or self.unchecked)


def claims_for(options: Options, changing_rules: Sequence[str], processes: int,
               rule_kinds: Sequence[str] = ()) -> _Claims:
    """What a rewrite with these options claims to change in training, for compare's checks.
    ``changing_rules``: the other changes-training rules that applied ("AR404 name")."""
    unchecked: list[str] = []
    if processes > 1:
        unchecked.append(f"{processes} processes, each with its share of the data")
    if options.accumulate and not options.keep_effective_batch:
        unchecked.append(f"--accumulate {options.accumulate} without --keep-effective-batch: each optimizer "
                         f"step sees {options.accumulate} times the samples")
    if options.group_by_length == "all":
        unchecked.append("--group-by-length all: the training batches are grouped by length")
    unchecked += list(changing_rules)
    basis = (APPROXIMATE if options.mixed_or_low_precision or _approximate_options(options)
             or "approximate" in rule_kinds else EXACT)
    return _Claims(basis=basis, freeze=tuple(options.freeze), clip_grad_norm=options.clip_grad_norm,
                   unchecked=tuple(unchecked))


#: the mixed precisions whose every trace the verifier can switch off from outside: Fabric's
#: precision (LT_PRECISION), every torch.autocast, every GradScaler
STRUCTURE_PRECISIONS = ("16-mixed", "bf16-mixed")
STRUCTURE_LABEL = "rewritten at 32-true"
NOISE_LABEL = "original under {precision}"
#: the precisions whose own effect on a script the harness reproduces: Fabric's bf16-mixed (the
#: outermost forwards under autocast, inputs and outputs cast). Not 16-mixed: its GradScaler
#: skips steps whose gradients overflow, which the noise run would not; nor a script's own
#: torch.autocast (the torch backend), whose region takes in the loss as well
NOISE_PRECISIONS = ("bf16-mixed",)
#: the rules whose changes are the precision itself: Fabric(precision=...), torch.autocast, the
#: GradScaler, the script's own autocast and scaler set to it; what they write is switched off in
#: the structure run
PRECISION_RULES = ("AR101", "AR207", "AR208", "AR213")


def _on_the_processes_batches(script: Path, script_args: Sequence[str], original: RunRecord, rewritten: RunRecord,
                              env: dict, common: dict, on_start: Callable[[str], None], notes: list[str],
                              tolerance: Tolerance, claims: Claims,
                              precision: Optional[str]) -> tuple[Optional[Verdict], Optional[RunRecord]]:
    """The processes held to the original run on their batches joined (shards.py), and that run;
    or None with a note saying why not (the verdict stays "not compared")."""
    n = rewritten.world_size
    same = shards.same_samples(rewritten.sampled or []) or shards.original_steps(original, rewritten)
    if same is not None:
        return Verdict(FAIL, same, {"tolerance": asdict(tolerance)}), None
    why = shards.why_not(rewritten)
    replayed = other = None
    if why is None:
        folder = Path(tempfile.mkdtemp(prefix="accelerate-rewrite-union-"))
        try:
            union = shards.write_union(rewritten, folder)
            on_start("original, joined batches")
            replayed = run_script(script, script_args, label=shards.REPLAY_LABEL.format(n=n), env=env,
                                  replay=union, **common)
            if replayed.ok and not replayed.replay_problem:
                on_start("original, reseeded")
                other = run_script(script, script_args, label=shards.RESEED_LABEL.format(n=n), env=env,
                                   replay=union, reseed=shards.RESEED,
                                   **{**common, "threads": shards.other_threads(common.get("threads"))})
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        verdict, why = shards.judge(replayed, other, rewritten, tolerance, claims, precision)
        if verdict is not None:
            notes.append(f"the original ran again on the batches the {n} processes drew, joined step by step, "
                         "and once more reseeded after its first step with another thread count (what other random "
                         "draws and another summation order change)")
            return verdict, replayed
    notes.append(f"the {n} processes were not held to the original on their batches joined: {why}")
    return None, None


def _with_structure(precision: Verdict, structure: Verdict, run: RunRecord, notes: list[str]) -> Verdict:
    """The verdict of a mixed-precision verification with its structure run: the rewrite with its
    precision switched off must match the original exactly (what bf16's noise would hide is in
    the structure), and then its precision run is judged as before."""
    precision.comparison["structure"] = {"verdict": structure.verdict, "reason": structure.reason,
                                         "max_rel_diff": structure.comparison.get("max_rel_diff"),
                                         "max_grad_norm_rel_diff": structure.comparison.get("max_grad_norm_rel_diff")}
    if structure.verdict == FAIL:
        also = (f"; and the precision run: {precision.label}: {precision.reason}"
                if precision.verdict not in (PASS, FAIL) else "")
        return Verdict(FAIL, f"structure: the rewrite run at 32-true (its precision switched off by the "
                             f"verifier) does not train as the original: {structure.reason}{also}",
                       precision.comparison)
    if structure.verdict != PASS:
        notes.append(f"the structure run at 32-true was not compared ({structure.label}: {structure.reason})")
        return precision
    if precision.verdict == PASS:
        steps = structure.comparison.get("steps")
        return Verdict(PASS, f"structure: exact at 32-true (the rewrite with its precision switched off: "
                             f"losses and gradient norms within {structure.comparison['tolerance']['max_rel']:g} "
                             f"at every one of {steps} steps); precision: {precision.reason}", precision.comparison)
    return precision


def ended_early(original: RunRecord, rewritten: RunRecord, steps: int, compared: Optional[int]) -> Optional[str]:
    """'compared 32 steps: the script ended after 32 of the 50 asked for' where a run made fewer
    steps than asked for and ended by itself (not stopped by the verifier, not failed: its data
    ran out, or its epochs did)."""
    if not compared or compared >= steps:
        return None
    ended = {run.label: len(run.losses) for run in (original, rewritten)
             if run.ok and not run.stopped_after_max_steps and len(run.losses) < steps}
    if not ended:
        return None
    o, r = ended.get(original.label), ended.get(rewritten.label)
    if o is not None and r is not None:
        why = (f"the script ended after {o} of the {steps} asked for" if o == r else
               f"the original ended after {o} and the rewritten script after {r} of the {steps} asked for")
    elif o is not None:
        why = f"the original ended after {o} of the {steps} asked for"
    else:
        why = (f"the rewritten script ended after {r} of the {steps} asked for "
               f"(the original ran {len(original.losses)})")
    return f"compared {compared} steps: {why}"


def load_average() -> float:
    """The machine's 1-minute load average (0 where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def _not_run(label: str, why: str) -> RunRecord:
    return RunRecord(label=label, error=f"not run: {why}")


@contextmanager
def _rewritten_file(script: Path, source: str) -> Iterator[Path]:
    """The rewritten script beside the original (so imports and relative paths work the same),
    or in a temporary folder when that folder can't be written; removed afterwards. The name is
    unique to this run (tempfile), so that two verifications of one script, run at once, never
    run each other's file."""
    folder: Optional[Path] = None
    try:
        handle, name = tempfile.mkstemp(prefix=f".{script.stem}.", suffix=".accelerate-rewrite-verify.py",
                                        dir=script.resolve().parent)
    except OSError:
        folder = Path(tempfile.mkdtemp(prefix="accelerate-rewrite-verify-"))
        handle, name = tempfile.mkstemp(prefix=f"{script.stem}.", suffix=".py", dir=folder)
    target = Path(name)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(source)
        yield target
    finally:
        try:
            target.unlink()
        except OSError:
            pass
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def _rewritten_project(script: Path, source: str, members: Sequence) -> Iterator[Path]:
    """A script whose rewrite changed the project's modules it imports too (codemod/project/program.py):
    the rewritten script and those modules in a temporary folder (a package a changed module is
    in, copied whole), which Python reads before the script's own folder (on PYTHONPATH for
    the modules that did not change); removed afterwards."""
    home = script.resolve().parent
    folder = Path(tempfile.mkdtemp(prefix="accelerate-rewrite-verify-"))
    try:
        for member in members:
            relative = Path(os.path.relpath(os.path.realpath(member.path), home))
            if relative.parts[0] == "..":
                continue  # not under the script's folder: can't be shadowed (never the case)
            if len(relative.parts) > 1 and not (folder / relative.parts[0]).exists():
                shutil.copytree(home / relative.parts[0], folder / relative.parts[0],
                                ignore=lambda d, names: [n for n in names if not (n.endswith(".py")
                                                                                  or os.path.isdir(os.path.join(d, n)))])
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_text(member.output, encoding="utf-8")
        target = folder / script.name
        target.write_text(source, encoding="utf-8")
        yield target
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@ending_runs_on_signals()  # SIGTERM, SIGHUP: the run going on ends, the rewritten file goes
def verify(
    script: Path,
    options: Options,
    *,
    script_args: Sequence[str] = (),
    against: Optional[Path] = None,
    steps: int = 50,
    run_on: Optional[str] = None,  # None: as the scripts choose; "cpu" or "cuda"
    run_devices: Optional[int] = None,
    timeout: float = 600.0,
    python: str = sys.executable,
    threads: Optional[int] = None,
    tolerance: Optional[Tolerance] = None,
    on_start: Callable[[str], None] = lambda label: None,
    rules: Optional[Sequence] = None,  # the rules to rewrite with (default: all)
    #: runs of the original to reuse, and to keep for the next verification of the same script
    #: with the same arguments and steps ("original", "noise bf16-mixed"): ``tune`` runs the
    #: original once for all its candidates
    reuse: Optional[dict] = None,
) -> Verification:
    from accelerate_rewrite.api import RewriteError, rewrite
    from accelerate_rewrite.codemod.project.program import Scope
    from accelerate_rewrite.codemod.files.source import SourceError, read_source
    from accelerate_rewrite.rules import BY_CODE

    script = Path(script)
    try:
        source = read_source(script)
    except SourceError as exc:
        raise VerifyError(str(exc)) from None
    notes: list[str] = []
    rule_kinds: list[str] = []
    structure_kinds: set[str] = set()
    changing_rules: list[str] = []
    own_precision = False  # AR213 set the script's own autocast: Fabric ran no precision of its own
    if against is not None:
        if not Path(against).is_file():
            raise VerifyError(f"{against}: no such file")
    else:
        try:
            # the project's modules it imports change with it (in a copy: nothing is written)
            result = rewrite(source.text, options, path=str(script), rules=rules, scope=Scope(follow=True))
        except RewriteError as exc:
            raise VerifyError(str(exc)) from None
        members = [m for m in result.members if m.changed]
        if members:
            notes.append("the rewritten script ran from a temporary folder, with the project's modules "
                         f"its rewrite changed ({', '.join(m.path for m in members)}); the script's own "
                         "folder is on its import path")
        if not result.changed and not members:
            reasons = "; ".join(n.message for n in result.skips[:3]) or "no rule applies"
            raise VerifyError(f"{script}: the rewrite changes nothing ({reasons}): nothing to verify")
        rewritten_source = result.output
        changes = [n for one in (result, *members) for n in one.changes]
        # what the changes are once the verifier switches the precision off: those of the rules
        # that write it (Fabric's precision, autocast, the GradScaler) keep the math then
        structure_kinds = {n.kind_with(options).value for n in changes
                           if n.rule in BY_CODE and n.rule not in PRECISION_RULES}
        rule_kinds = sorted({n.kind_with(options).value for n in changes if n.rule in BY_CODE})
        own_precision = any(n.rule == "AR213" for n in changes)
        changing_rules = sorted({f"{n.rule} ({BY_CODE[n.rule].name})" for n in changes
                                 if n.rule in BY_CODE and n.rule not in _OPTION_RULES
                                 and n.kind_with(options).value == CHANGES_TRAINING})

    env = dict(os.environ)
    rewritten_env = dict(env)
    substituted: Optional[str] = None
    if run_on == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = rewritten_env["CUDA_VISIBLE_DEVICES"] = ""
        rewritten_env["LT_ACCELERATOR"] = "cpu"
        strategy = options.strategy or ""
        if strategy.startswith(("fsdp", "deepspeed")):
            rewritten_env["LT_STRATEGY"] = "ddp"
            substituted = (f"--strategy {strategy} was not verified: it runs on GPUs only, and on the CPU "
                           "the rewritten script ran with ddp instead")
            notes.append(f"--strategy {strategy} does not run on CPU: the rewritten script ran with ddp")
        notes.append("both scripts ran on the CPU (CUDA hidden; Fabric's accelerator set to cpu)")
    elif run_on == "cuda":
        rewritten_env["LT_ACCELERATOR"] = "cuda"
    processes = run_devices or (options.effective_devices if isinstance(options.effective_devices, int) else 1)
    launcher: list[str] = []
    if options.accelerate and processes > 1:
        # Accelerate starts no process itself: torchrun starts them, as the summary's line does
        # (``accelerate launch --multi_gpu`` is torch's elastic launcher too), each with the harness
        launcher = torchrun(python, processes)
        if run_on == "cpu" or (options.accelerator or "auto") == "cpu":
            rewritten_env["ACCELERATE_USE_CPU"] = "1"  # as Accelerator(cpu=True): one process is not N
        notes.append(f"the rewritten script ran on {processes} processes, started by torchrun")
    elif run_devices is not None:
        rewritten_env["LT_DEVICES"] = str(run_devices)
        notes.append(f"the rewritten script ran on {run_devices} device(s) (LT_DEVICES)")

    claims = claims_for(options, changing_rules, processes if processes > 1 else 1, rule_kinds)
    kind = tolerance_kind(options, rule_kinds, processes if processes > 1 else 1)
    base = tolerance or Tolerance()
    tol = replace(base, kind=kind)

    # what the options need from the machine, before anything runs
    needed = environment.needs(options, run_on, run_devices, against=against is not None)
    if needed:
        machine = environment.probe(python, needed, env=rewritten_env, cwd=Path.cwd())
        lacking = environment.missing(needed, machine)
        if lacking:
            why = environment.describe(lacking, machine)
            if any(n.why.startswith("--strategy fsdp") or n.why.startswith("--strategy deepspeed")
                   for n in lacking if n.what == environment.CUDA):
                why += ("; or --run-on cpu, which runs the rest of the rewrite with ddp on the CPU "
                        "(reported as not verified, with the curves)")
            verdict = Verdict(NOT_VERIFIED, f"{why}; nothing was run",
                              {"tolerance": asdict(tol), "needs": [n.what for n in lacking]})
            return Verification(script, options, verdict, _not_run("original", "the machine can't run the options"),
                                _not_run("rewritten", "the machine can't run the options"), against, notes)

    common = dict(max_steps=steps, cwd=Path.cwd(), timeout=timeout, python=python, threads=threads,
                  track_params=bool(options.freeze))
    # several processes: each one's batches, to hold them to the original on them joined (shards.py)
    sampled = dict(record_batches=shards.batches_to_record(steps, options.accumulate)) if processes > 1 else {}
    traced = dict(trace_precision=HALF.get(options.precision or "", False))
    # the structure run (issue 27.1): a mixed precision whose rewrite keeps the math otherwise
    # runs once more with its precision switched off, and that run is held to the original exactly
    structural = (kind == APPROXIMATE and options.precision in STRUCTURE_PRECISIONS
                  and not _approximate_options(options) and APPROXIMATE not in structure_kinds
                  and CHANGES_TRAINING not in structure_kinds)
    structure: Optional[RunRecord] = None
    noise: Optional[RunRecord] = None
    load = load_average()
    reuse = {} if reuse is None else reuse
    key = "original, parameters tracked" if common["track_params"] else "original"
    original = reuse.get(key)
    if original is None:
        on_start("original")
        original = reuse[key] = run_script(script, script_args, label="original", env=env, **common)
    if original.timed_out:  # no verdict can come of it: don't wait a second timeout
        rewritten = RunRecord(label="rewritten", error="not run: the original timed out")
        notes.append(f"the rewritten script was not run: the original timed out after {timeout:g} s")
    elif against is not None:  # the user's own file, run where it is
        on_start("rewritten")
        rewritten = run_script(Path(against), script_args, label="rewritten", env=rewritten_env, launcher=launcher,
                               **common, **traced, **sampled)
        if structural and rewritten.ok:
            on_start("structure")
            structure = run_script(Path(against), script_args, label=STRUCTURE_LABEL, launcher=launcher,
                                   env={**rewritten_env, "LT_PRECISION": "32-true"}, force_fp32=True, **common)
    else:
        on_start("rewritten")
        with (_rewritten_project(script, rewritten_source, members) if members
              else _rewritten_file(script, rewritten_source)) as rewritten_path:
            if rewritten_path.parent != script.resolve().parent:  # the script's folder was read-only
                rewritten_env["PYTHONPATH"] = os.pathsep.join(
                    filter(None, [str(script.resolve().parent), rewritten_env.get("PYTHONPATH")]))
            rewritten = run_script(rewritten_path, script_args, label="rewritten", env=rewritten_env,
                                   launcher=launcher, **common, **traced, **sampled)
            if structural and rewritten.ok:
                on_start("structure")
                structure = run_script(rewritten_path, script_args, label=STRUCTURE_LABEL, launcher=launcher,
                                       env={**rewritten_env, "LT_PRECISION": "32-true"}, force_fp32=True, **common)
        if rewritten.error:
            rewritten.error = rewritten.error.replace(str(rewritten_path), f"{script} (rewritten)")

    structure_verdict = compare(original, structure, replace(tol, kind=EXACT)) if structure is not None else None
    if (structure_verdict is not None and structure_verdict.verdict == PASS and rewritten.fabric
            and not own_precision and rewritten.precision in NOISE_PRECISIONS):
        # the noise run (issue 27.1): the original once more, its modules' forwards run as Fabric
        # runs a set-up module under the precision the rewritten run used (16-mixed is bf16 on a CPU)
        key = f"noise {rewritten.precision}"
        noise = reuse.get(key)
        if noise is None:
            on_start("noise")
            noise = reuse[key] = run_script(script, script_args, label=NOISE_LABEL.format(precision=rewritten.precision),
                                            env=env, autocast_forward=HALF[rewritten.precision], **common)
    floor = noise_floor(original, noise) if noise is not None else None
    if noise is not None and floor is None:
        notes.append(f"the original under {noise.label.split()[-1]} did not run to a step "
                     f"({last_line(noise.error) or 'no step'}): the precision was held to the fixed tolerances")

    notes.extend(run.exit_note for run in (original, rewritten) if run.exit_note)
    if rewritten.world_size > 1 and processes <= 1:  # the script's own Fabric(devices=N)
        claims = claims_for(options, changing_rules, rewritten.world_size, rule_kinds)
        tol = replace(tol, kind=CHANGES_TRAINING)
    verdict = compare(original, rewritten, tol, requested_precision=options.precision, claims=claims, noise=floor)
    joined = None
    if sampled and verdict.verdict == NOT_COMPARED and rewritten.world_size > 1:
        held, joined = _on_the_processes_batches(
            script, script_args, original, rewritten, env, common, on_start, notes,
            replace(base, kind=tolerance_kind(options, rule_kinds, 1)),
            claims_for(options, changing_rules, 1, rule_kinds), options.precision)
        verdict = held or verdict
    if structure_verdict is not None:
        verdict = _with_structure(verdict, structure_verdict, structure, notes)
    verdict.comparison.update(load_average=max(load, load_average()), cores=os.cpu_count(), steps_asked=steps)
    early = ended_early(original, rewritten, steps, verdict.comparison.get("steps"))
    if early is not None:  # issue 48: how many steps were compared, and why not the number asked for
        verdict.comparison["ended_early"] = early
        verdict = Verdict(verdict.verdict, f"{verdict.reason}; {early}", verdict.comparison)
    if substituted is not None and verdict.verdict not in ("error",):
        verdict = Verdict(NOT_VERIFIED, f"{substituted}; with ddp: {verdict.label}: "
                                        f"{verdict.reason}", verdict.comparison)
    return Verification(script, options, verdict, original, rewritten, against, notes, structure, joined)

