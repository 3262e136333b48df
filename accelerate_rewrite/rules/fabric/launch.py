from __future__ import annotations

import libcst as cst

from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.codemod.analysis.facts import code
from accelerate_rewrite.rules.base.plan import FabricRule, core_except, NAME, expr, short, stmt
from accelerate_rewrite.options import MIXED_PRECISIONS
from accelerate_rewrite.rules.fabric._plan import plan
from accelerate_rewrite.rules.base.half import MIXED_GROUND


class _Code(str):
    """A Fabric argument written as code (``devices=world_size``), not as a literal."""


class FabricLaunch(FabricRule):
    """Create `Fabric(...)` with the options given, and launch it.

    What it does: imports `Fabric` from `lightning.fabric`, creates `fabric = Fabric(...)` with
    the options that differ from Fabric's defaults (accelerator, strategy, devices, num_nodes,
    precision) and always `devices`: without `--devices` it is 1, the one device the original
    ran on (Fabric's own default, "auto", would take every GPU of the machine), unless a
    strategy or several nodes ask for more; and calls `fabric.launch()` right after, before any set-up call
    (unless `--devices 1` without a strategy: DDP, FSDP and DeepSpeed need it on one device too). The lines go where the script starts to deal with the device, the
    model or the data; a device definition that the conversion makes unused is replaced by them.
    A script that starts its own processes (AR111) gets them where it started them, with its
    own world size as `devices`; `mp.spawn(fn, ...)` becomes `fabric.launch(fn, ...)`.

    Why: Fabric owns the device, the processes and the precision; every other Fabric rule
    relies on this object.

    Kind: safe at 32-true; the precision option itself is what makes numerics change.

    Leaves alone (and says why): scripts that already use Lightning Fabric, the Lightning
    Trainer or Hugging Face Accelerate (importing lightning only for `seed_everything` does not
    count); hand-made distributed training that AR111 can't take over (it says why);
    scripts with nothing to train; scripts a library makes its own (Opacus's
    `PrivacyEngine.make_private`: differential privacy); strategies that need `launch(fn)` (ddp_spawn,
    ddp_notebook, ...); models built inside a class other than in the `__init__` of an
    object made once, a method only that `__init__` calls, or a method called once on it
    (that object gets `fabric` where it is made). It does not set a mixed
    precision over a script that already runs its own autocast/GradScaler, nor any low
    precision with LBFGS.
    """

    code = "AR101"
    name = "fabric-launch"
    kind = Kind.SAFE
    requires = core_except("AR101")
    examples = (Example.from_files("AR101", options={"precision": "bf16-mixed", "devices": 4}),)

    def rewrite(self, ctx: RuleContext) -> None:
        p = plan(ctx.facts, ctx.options)
        if p.refusal is not None:
            node, why = p.refusal
            ctx.skip(node, f"Fabric conversion: {why}")
            return
        kwargs = ctx.options.fabric_kwargs()
        if p.precision not in (ctx.options.precision, None, "32-true"):  # apex's opt_level
            kwargs["precision"] = p.precision
        if p.omit_precision is not None:
            kwargs.pop("precision", None)
            ctx.skip(*p.omit_precision)
        if kwargs.get("precision") in MIXED_PRECISIONS:
            ctx.provide(MIXED_GROUND)
        ddp = p.ddp
        if ddp is not None:
            self._hand_ddp(ctx, p, kwargs)
        args = ", ".join(f"{k}={v}" if isinstance(v, _Code) else f"{k}={v!r}" if isinstance(v, int)
                         else f'{k}="{v}"' for k, v in kwargs.items())
        lines: list[cst.BaseStatement] = [stmt(f"{NAME} = Fabric({args})\n")]
        if ddp is not None and ddp.spawn is not None:
            sp = ddp.spawn
            launch_args = ", ".join([sp.worker.name.value, *(code(a) for a in sp.args)])
            lines[0] = lines[0].with_changes(leading_lines=[])
            ctx.edits.insert_before(sp.where, *lines)
            ctx.edits.replace(sp.call, expr(f"{NAME}.launch({launch_args})"))
            ctx.edits.add_import("lightning.fabric", "Fabric")
            ctx.change(sp.stmt, f"`{short(sp.call)}` became `{NAME} = Fabric({args})` and "
                                f"`{NAME}.launch({launch_args})`: Fabric starts the processes", kind=_kind(kwargs))
            for direct in sp.direct:
                call = direct.body[0].value
                ctx.edits.replace(call, expr(f"{NAME}.launch({launch_args})"))
                ctx.change(direct, f"`{short(call)}` became `{NAME}.launch({launch_args})`: the processes are "
                                   f"Fabric's (devices) on this branch too, and `{sp.worker.name.value}` receives "
                                   f"`{NAME}` where it was given `{code(call.args[0].value)}`")
            return
        # a strategy of several processes (ddp, fsdp, deepspeed) needs launch() even on one device
        launch = not ctx.options.single_device or (ctx.options.strategy or "auto") != "auto"
        if launch:
            lines.append(stmt(f"{NAME}.launch()\n"))
        if not p.replaces_anchor:
            # set the new lines off as the anchor is: the blank lines above it (not its comments)
            blanks = []
            for line in p.anchor.leading_lines:
                if line.comment is not None:
                    break
                blanks.append(line)
            lines[0] = lines[0].with_changes(leading_lines=blanks)
        ctx.edits.insert_before(p.anchor, *lines)
        ctx.edits.add_import("lightning.fabric", "Fabric")
        ctx.change(p.anchor, f"created `{NAME} = Fabric({args})`" + (" and launched it" if launch else ""),
                   kind=_kind(kwargs))

    @staticmethod
    def _hand_ddp(ctx: RuleContext, p, kwargs: dict) -> None:
        """Hand-made DDP: Fabric's devices are the script's world size unless --devices is given."""
        ddp, o = p.ddp, ctx.options
        # DDP's options only matter with several processes; on one device (--devices 1) a DDP
        # strategy would also swap the script's RandomSampler for a DistributedSampler
        if o.strategy is None and ddp.strategy is not None and o.devices != 1:
            if ddp.strategy.startswith("DDPStrategy("):
                kwargs["strategy"] = _Code(ddp.strategy)
                ctx.edits.add_import("lightning.fabric.strategies", "DDPStrategy")
            else:
                kwargs["strategy"] = ddp.strategy
        if o.devices is not None:
            return
        if ddp.spawn is not None:
            if ddp.spawn.nprocs is None:
                kwargs["devices"] = 1
            elif ddp.spawn.may_be_zero:
                # ``torch.cuda.device_count()`` is 0 without CUDA: Fabric(devices=0) raises where the
                # script ran (mp.spawn started nothing, its direct call one process)
                kwargs["devices"] = _Code(f"max({code(ddp.spawn.nprocs)}, 1)")
                ctx.change(ddp.spawn.stmt, f"devices=max({code(ddp.spawn.nprocs)}, 1): "
                                           f"`{code(ddp.spawn.nprocs)}` counts CUDA devices, 0 on a machine "
                                           "without them, where the script ran on one process")
            else:
                kwargs["devices"] = _Code(code(ddp.spawn.nprocs))
        else:
            devices = 'int(os.environ.get("LOCAL_WORLD_SIZE", 1))'
            kwargs["devices"] = _Code(devices)
            ctx.edits.add_import("os")
            strategy = kwargs.get("strategy")
            if o.strategy is None and strategy is not None:
                # one process without torchrun: no DDP (its sampler would not be the script's)
                text = str(strategy) if isinstance(strategy, _Code) else f'"{strategy}"'
                kwargs["strategy"] = _Code(f'{text} if {devices} > 1 else "auto"')
        # keep Fabric's keyword order: devices after accelerator and strategy
        order = ("accelerator", "strategy", "devices", "num_nodes", "precision")
        items = sorted(kwargs.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 99)
        kwargs.clear()
        kwargs.update(items)


def _kind(kwargs: dict) -> Kind:
    """What the Fabric written does to the numbers: its precision, as written (the summary's
    numerics line reads it from the note, so it never claims a precision the file does not set)."""
    return Kind.SAFE if kwargs.get("precision") in (None, "32-true", "64-true") else Kind.APPROXIMATE
