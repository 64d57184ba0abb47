"""`portagrpo plan`: the memory plan of a run before it starts, printed (the plan itself is portagrpo/plan/: memory.py
its arithmetic, shapes.py the model's shape, gate.py the plan of a config and the refusal that stops a run).

    portagrpo plan --config C [overrides] [--device D] [--nodes N --devices-per-node D --device-memory-gb M
                   --host-memory-gb H] [--json F]

The model is read from its config.json alone (a directory without weights is enough); where model.path has none
on this machine, the shape of a well-known model of the same name shipped with portagrpo (plan/model_shapes/) is
used, and the plan says so. The cluster comes from the flags, else from the config (trainer.nnodes,
trainer.devices_per_node or trainer.nproc_per_node, trainer.device_memory_gb, trainer.host_memory_gb).

It is as strict as `train`: a layout `train` refuses (batch divisions, shard groups, sequence-parallel groups) is
refused here with the same sentence, from the same rule; nonsense cluster numbers and a config.json transformers
cannot read are one sentence; `--json` writes a new file or replaces an earlier plan report, never another file.
"""
from __future__ import annotations

from dataclasses import replace

from portagrpo.plan.gate import plan_config, usable
from portagrpo.plan.memory import GIB, Plan, plan


def describe(p: Plan, source: str) -> list[str]:
    """The plan as lines of text: the model, each phase's per-rank peak and what it holds, host memory, the verdict."""
    m, c, r = p.model, p.cluster, p.run
    moe = (f", MoE {m.experts} experts (top {m.experts_per_token}): {m.active_params / 1e9:.2f}B active"
           if m.is_moe else "")
    lines = [f"memory plan: {m.name}, {m.params / 1e9:.2f}B parameters{moe} (shape from {source})",
             f"  cluster: {c.nodes} node(s) x {c.devices_per_node} device(s) of {c.device_memory_gb:g} GiB"
             f"{usable(c)}, {c.host_memory_gb:g} GiB host memory per node; {r.strategy}"
             + (f" (shard groups of {r.shard_group})" if r.strategy in ("fsdp2", "ep") else "")
             + (f", experts split over groups of {r.ep}" if r.strategy == "ep" else "")
             + f"; rollout engine {r.engine}"
             + ("; each rank's sampler process on a device of its own (rollout.mode=one_step_off, the phase "
                "'sampler')" if r.sampler_apart else ""),
             "  per device, each phase's peak (GiB):"]
    for phase in p.phases:
        held = ", ".join(f"{k} {v / GIB:.2f}" for k, v in phase.items.items() if v > 0)
        lines.append(f"    {phase.name:<10} {phase.total / GIB:8.2f}   {held}")
    other = replace(r, gradient_checkpointing=not r.gradient_checkpointing)
    update_other = next(ph.total for ph in plan(m, c, other).phases if ph.name == "update")
    update_now = next(ph.total for ph in p.phases if ph.name == "update")
    on, off = (update_now, update_other) if r.gradient_checkpointing else (update_other, update_now)
    lines.append(f"  update with gradient checkpointing: {on / GIB:.2f} GiB; without: {off / GIB:.2f} GiB "
                 f"(model.gradient_checkpointing={str(r.gradient_checkpointing).lower()} here)")
    host = sum(p.host_per_node.values())
    lines.append(f"  host memory per node: {host / GIB:.1f} GiB ("
                 + ", ".join(f"{k} {v / GIB:.1f}" for k, v in p.host_per_node.items() if v > 0) + ")")
    if p.pinned_per_node:
        lines.append(f"  of which page-locked: {p.pinned_per_node / GIB:.1f} GiB per node (actor.pin_offload=false "
                     f"keeps the offloaded shards pageable)")
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(f"  {verdict}: peak {p.peak.total / GIB:.2f} GiB in {p.peak.name} of {c.capacity / GIB:.1f} usable "
                 f"GiB per device; host {host / GIB:.1f} of {c.host_memory_gb:g} GiB per node")
    for advice in p.advice:
        lines.append(f"  would fit with: {advice}")
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the memory plan of a run: each device's peak per phase, whether it fits")
    p.add_argument("--config", help="YAML recipe (see configs/)")
    p.add_argument("--device", help="the device kind to plan for, as `train --device` takes it (default "
                   "trainer.device; auto plans for cuda)")
    p.add_argument("--nodes", type=int, help="nodes (default trainer.nnodes)")
    p.add_argument("--devices-per-node", type=int, help="devices per node (default trainer.devices_per_node, or "
                   "trainer.nproc_per_node on one node)")
    p.add_argument("--device-memory-gb", type=float, help="memory of one device in GiB (default "
                   "trainer.device_memory_gb)")
    p.add_argument("--host-memory-gb", type=float, help="host memory of one node in GiB (default "
                   "trainer.host_memory_gb, else 1024)")
    p.add_argument("--json", help="write the plan as JSON to this file")
    p.add_argument("overrides", nargs="*", help="key=value overrides with dotted keys")


def cmd_plan(args) -> int:
    from portagrpo.config import load_config
    from portagrpo.fileio import check_report_destination, write_report

    if args.json:
        check_report_destination(args.json, "plan --json", "plan")
    notices: list[str] = []
    overrides = list(args.overrides) + ([f"trainer.device={args.device}"] if args.device else [])
    cfg = load_config(args.config, overrides, check_files=False, notices=notices)
    for line in notices:
        print(f"portagrpo: {line}")
    p, source = plan_config(cfg, args)
    for line in describe(p, source):
        print(line)
    if args.json:
        write_report(args.json, {**p.as_json(), "shape_source": source}, "plan")
    return 0 if p.fits else 1
