"""gossipd mesh up and gossipd demo: local meshes of real daemons, their flags and runners.

Both commands start N daemons on loopback with the same flags
(:mod:`gossipd.node.cli.mesh_flags`) and differ in what they run: ``mesh up`` one mesh
with optional link shaping, ``demo`` each site alone and then with gossip. They live
apart from :mod:`gossipd.node.cli.main` so that the top-level parser reads as a list of
commands.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from gossipd.node.cli.mesh_flags import add_mesh_args
from gossipd.node.errors import GossipdError
from gossipd.node.launch.joboptions import parse_job_options
from gossipd.node.protocols import DEFAULT_PROTOCOL


def _mesh_spec(args: argparse.Namespace, **overrides: object) -> object:
    from gossipd.node.launch.meshspec import MeshSpec

    fields = {
        "nodes": args.nodes,
        "job": args.job,
        "protocol": args.protocol,
        "round_steps": args.round_steps,
        "insecure": args.insecure,
        "duration_s": args.duration_s,
        "max_steps": args.max_steps,
        "max_steps_per_s": args.max_steps_per_s,
        "push_probability": args.push_probability,
        "cpu_share": args.cpu_share,
        "codec": args.codec,
        "error_feedback": args.error_feedback,
        "learning_rate": args.learning_rate,
        "workdir": _fresh_workdir(args.workdir),
        "plot_path": Path(args.plot) if args.plot else None,
        "seed": args.seed,
        "ranks": args.ranks,
        "device": args.device,
        "quiet": args.json,
        "job_options": parse_job_options(args.job_option),
        "coordinator": args.coordinator == "local",
        "protocol_options": _protocol_options(args),
    }
    if args.node_based is not None:
        fields.update(_node_based(args))
    fields.update(overrides)
    return MeshSpec(**fields)  # type: ignore[arg-type]


def _fresh_workdir(text: str | None) -> Path | None:
    """``--workdir``, refused while it holds an earlier run's node state: its nodes would
    resume from their checkpoints instead of training anew (and stop at once where they
    had reached ``--max-steps``), and this run's summary would describe that one."""
    if not text:
        return None
    workdir = Path(text)
    earlier = sorted(workdir.glob("node-*/checkpoint.pt")) or sorted(
        workdir.glob("*/node-*/checkpoint.pt")  # demo: local-only/ and gossip/
    )
    if earlier:
        raise GossipdError(
            f"--workdir {workdir} holds an earlier run's node state ({earlier[0]}): its "
            "nodes would resume from those checkpoints, not train anew; give a new or empty "
            "--workdir, or remove that one"
        )
    return workdir


def _node_based(args: argparse.Namespace) -> dict[str, object]:
    """eDNNcomm's node-based mode: persyn between site leaders every K′ steps and at the end
    of each epoch of a rank's data (the same epoch length on every site)."""
    if args.protocol not in (DEFAULT_PROTOCOL, "persyn"):
        raise GossipdError(f"--node-based runs persyn between sites, not {args.protocol}")
    if args.node_based < 1:
        raise GossipdError(f"--node-based {args.node_based}: give K′ >= 1 steps between averages")
    from gossipd.node.jobs.registry import JobSpec, build_job
    from gossipd.node.jobs.spec import steps_per_epoch_of
    from gossipd.node.trainer.ranks import RankEnv

    site = JobSpec(
        args.job,
        shard_index=0,
        num_shards=args.nodes,
        learning_rate=args.learning_rate,
        options=parse_job_options(args.job_option),
    )
    job = build_job(RankEnv(0, args.ranks, 0).job_spec(site) if args.ranks > 1 else site)
    epoch = steps_per_epoch_of(job)
    if not isinstance(epoch, int) or epoch < 1:
        raise GossipdError(
            f"--node-based: job {args.job!r} does not say how many steps an epoch has "
            "(a steps_per_epoch attribute); set [gossip.persyn] epoch_steps in its configs"
        )
    options = {"average_every_steps": args.node_based, "epoch_steps": epoch}
    return {"protocol": "persyn", "protocol_options": options}


def _protocol_options(args: argparse.Namespace) -> dict[str, object]:
    """The flags that set one protocol's (or baseline's) own settings, refused with another."""
    own = {
        "overlap": {"mode": args.overlap_mode, "period_steps": args.period_steps},
        "diloco": {"inner_steps": getattr(args, "inner_steps", None)},  # mesh up only
    }
    chosen: dict[str, object] = {}
    for protocol, options in own.items():
        given = {k: v for k, v in options.items() if v is not None}
        if given and args.protocol != protocol:
            flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
            raise GossipdError(f"{flags}: only for --protocol {protocol}, not {args.protocol}")
        if protocol == args.protocol:
            chosen = given
    return chosen


def _run_demo(args: argparse.Namespace) -> int:
    # Said before the heavy imports (torch takes seconds to load on a busy machine).
    print(
        f"gossipd: loading PyTorch to start {args.nodes} nodes twice: each site alone "
        "(no gossip), then the same sites with gossip...",
        file=sys.stderr if args.json else sys.stdout,
        flush=True,
    )
    from gossipd.node.launch.demo import (
        DEMO_CPU_SHARE,
        busy_machine,
        demo_job_options,
        print_demo,
        run_demo,
    )

    warning = busy_machine(os.getloadavg()[0], len(os.sched_getaffinity(0)))
    if warning is not None:
        print(warning, file=sys.stderr if args.json else sys.stdout, flush=True)
    options = demo_job_options(args.job, parse_job_options(args.job_option))
    with contextlib.ExitStack() as stack:
        broker = None
        if args.discovery == "mqtt":
            from gossipd.node.launch.broker import EmbeddedBroker

            broker = stack.enter_context(EmbeddedBroker()).address
            print(
                f"gossipd: the sites have no seeds; they find each other through an MQTT "
                f"broker (amqtt) started in this process on {broker}",
                file=sys.stderr if args.json else sys.stdout,
                flush=True,
            )
        share = DEMO_CPU_SHARE if args.cpu_share is None else args.cpu_share
        spec = _mesh_spec(args, job_options=options, mqtt_broker=broker, cpu_share=share)
        result = run_demo(spec)  # type: ignore[arg-type]
    print_demo(result, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


def _run_mesh(args: argparse.Namespace) -> int:
    # Said before the heavy imports (torch takes seconds to load on a busy machine).
    print(
        f"gossipd: loading PyTorch to start {args.nodes} nodes...",
        file=sys.stderr if args.json else sys.stdout,
        flush=True,
    )
    from gossipd.node.launch.launcher import print_table, run_mesh
    from gossipd.node.net.wire.shaping import link_tables

    link = link_tables(args.nodes, latency_ms=args.link_latency_ms, rate_mbit=args.link_rate_mbit)
    result = run_mesh(_mesh_spec(args, link=link))  # type: ignore[arg-type]
    print_table(result, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result))
    return 0 if result["ok"] else 1


def add_mesh_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ``mesh`` (with ``up``) and ``demo`` subcommands, in that order in ``--help``."""
    mesh = sub.add_parser("mesh", help="local multi-process meshes")
    mesh_sub = mesh.add_subparsers(dest="mesh_command", required=True)
    p = mesh_sub.add_parser(
        "up",
        help="spawn N daemons on loopback, train, report, stop",
        description="Spawn N gossipd daemons on loopback, train, print progress and a "
        "per-node table, stop them.",
    )
    add_mesh_args(p, nodes=4, duration_s=30.0, job="digits", baseline=True)
    p.add_argument(
        "--link-latency-ms",
        metavar="MS[,MS...]",
        help="test/benchmark knob: [link] latency_ms of every node, or one value per node "
        "separated by commas (default: none)",
    )
    p.add_argument(
        "--link-rate-mbit",
        metavar="MBIT[,MBIT...]",
        help="test/benchmark knob: [link] rate_mbit (send-rate cap) of every node, or one "
        "value per node separated by commas (default: no cap)",
    )
    p.set_defaults(func=_run_mesh)

    p = sub.add_parser(
        "demo",
        help="4 digits sites with skewed data, alone then with gossip, about two minutes, plot",
        description="Four daemons on loopback train an MLP on scikit-learn's bundled digits "
        "(nothing is downloaded), each on about three of the ten classes (partition "
        "by_label): first each site alone (sumweight with push_probability 0), then the same "
        "sites with gossip, 30 s each; prints progress, each site's final accuracy alone and "
        "with gossip, and writes gossipd-demo.png with both runs.",
    )
    add_mesh_args(p, nodes=4, duration_s=30.0, job="digits")
    p.add_argument(
        "--discovery",
        choices=("seeds", "mqtt"),
        default="seeds",
        help="how the sites find each other: seeds (each is given the others' addresses) or "
        "mqtt (no seeds; an MQTT broker started in this process) (default: %(default)s)",
    )
    p.set_defaults(func=_run_demo, plot_default="gossipd-demo.png")
