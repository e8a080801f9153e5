"""`gossipd sim`: its flags, the run they describe, and the JSON line (the progress line,
the table and the plot are :mod:`.output`).

Heavy imports (numpy, torch, matplotlib) wait until the command runs, so
building the ``gossipd`` parser stays cheap for every other subcommand.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from gossipd.node.errors import ConfigError
from gossipd.node.protocols import PROTOCOLS, protocol_settings, settings_class
from gossipd.node.protocols.settings import explain
from gossipd.node.sim.output import Progress, plot_result, print_table
from gossipd.node.sim.scenarios import SCENARIOS, EventKind, load_scenario, parse_fault

if TYPE_CHECKING:
    from gossipd.node.sim.spec import SimSpec


@dataclass(frozen=True)
class Flag:
    """One flag of ``gossipd sim``: its name, its help, and argparse's other arguments.

    The help text gets ``(default: …)`` appended: the flag's default, or ``shown_default``.
    ``choices`` are read when the parser is built, not at import: the registry may grow."""

    name: str
    help: str
    options: Mapping[str, Any] = field(default_factory=dict)
    shown_default: str = "%(default)s"
    choices: Callable[[], list[str]] | None = None


FAULT_KINDS: tuple[tuple[EventKind, str], ...] = (
    ("fail", "NODE@TIME"),
    ("leave", "NODE@TIME"),
    ("join", "TIME"),
)

FLAGS: tuple[Flag, ...] = (
    Flag(
        "--protocol",
        "gossip protocol core of every node",
        {"default": "sumweight"},
        choices=lambda: sorted(PROTOCOLS),
    ),
    Flag("--nodes", "simulated nodes", {"type": int, "default": 16}),
    Flag("--rounds", "rounds to simulate at most", {"type": int, "default": 20}),
    Flag("--segments", "model segments", {"type": int, "default": 4}),
    Flag(
        "--scenario",
        f"network and faults: {', '.join(SCENARIOS)}, or a .json file with the fields of "
        "gossipd.node.sim.scenarios.Scenario",
        {"default": "homogeneous"},
    ),
    Flag("--seed", "seed of everything", {"type": int, "default": 0}),
    Flag(
        "--payload",
        "what nodes hold: a float64 vector per node, training off (consensus studies), or "
        "a digits MLP per node trained with real torch steps",
        {"choices": ["vector", "digits"], "default": "vector"},
    ),
    Flag("--dim", "vector length, vector payload", {"type": int, "default": 64}),
    Flag(
        "--model-bytes",
        "size of the model on the simulated wire, for transfer times and byte counts; "
        "0: the payload's own size",
        {"type": int, "default": 0},
    ),
    Flag(
        "--round-steps",
        "local steps per round; also the protocol's round_steps if it has one",
        {"type": int, "default": 1},
    ),
    Flag(
        "--set",
        "a setting of the protocol, as in a node's [gossip.<protocol>] table (a TOML "
        "value), repeatable, e.g. --set push_probability=1; unset: the protocol's defaults, "
        "but round_steps from --round-steps and average_every_steps ceil(log2 N)",
        {"action": "append", "default": [], "metavar": "KEY=VALUE"},
        shown_default="none",
    ),
    Flag(
        "--average-every-steps",
        "deprecated: --set average_every_steps=K; 0: not given",
        {"type": int, "default": 0},
    ),
    Flag(
        "--max-in-flight",
        "unacknowledged pushes per node; 0: max(4, segments, isqrt(N-1)+3), enough for a "
        "round of any protocol (the daemon's default is 4)",
        {"type": int, "default": 0},
    ),
    Flag(
        "--weight-balance",
        "scale pushes so a node's weight does not follow its speed (the daemon's "
        "gossip.weight_balance); off: the protocols' shares as published",
        {"action": argparse.BooleanOptionalAction, "default": True},
    ),
    Flag(
        "--peer-credit",
        "the most of a node's weight one peer may hold, net, per segment (the daemon's "
        "limits.peer_credit); inf: the protocols' shares as published",
        {"type": float, "default": None},
        shown_default="the protocol's: 1/3, or 1/2 for pushsum-expgraph and persyn",
    ),
    Flag(
        "--codec",
        "how pushed segments travel, as gossip.codec: raw, fp16, bf16, int8, int4, or topk2 "
        "and topk4 with --error-feedback (bytes: the encoded segment's against float32's)",
        {"choices": ["raw", "fp16", "bf16", "int8", "int4", "topk2", "topk4"], "default": "raw"},
    ),
    Flag(
        "--topk-fraction",
        "of a segment's entries topk2 and topk4 send (gossip.topk_fraction)",
        {"type": float, "default": 0.01},
    ),
    Flag(
        "--error-feedback",
        "send each segment as its difference from a copy both ends hold, the sender keeping "
        "what the codec dropped (gossip.error_feedback)",
        {"action": argparse.BooleanOptionalAction, "default": False},
    ),
    Flag(
        "--feedback-peers",
        "peers whose copies each node keeps with --error-feedback (gossip.feedback_peers)",
        {"type": int, "default": 8},
    ),
    Flag(
        "--push-probability",
        "deprecated: --set push_probability=P",
        {"type": float, "default": None},
    ),
    Flag(
        "--learning-rate",
        "digits payload: SGD learning rate, 0 for training off; unset: the job's default",
        {"type": float, "default": None},
    ),
    Flag(
        "--target-error",
        "stop early once the consensus error (and its prediction, if tracked) is at most "
        "this; 0: run every round",
        {"type": float, "default": 0.0},
    ),
    *(
        Flag(
            f"--{kind}",
            f"add a '{kind}' fault entry to the scenario, repeatable",
            {"action": "append", "default": [], "metavar": form},
            shown_default="none",
        )
        for kind, form in FAULT_KINDS
    ),
    Flag(
        "--loss",
        "probability that a payload or an acknowledgement is lost; unset: the scenario's",
        {"type": float, "default": None},
    ),
    Flag(
        "--predict",
        "track the mixing matrices and predict the error from sigma_1(P_k - J); unset: "
        "when N <= 256 (at most 1024; vectors without membership changes)",
        {"action": argparse.BooleanOptionalAction, "default": None},
    ),
    Flag(
        "--coordinator",
        "one coordinator schedules the pulls of cores that ask one (overlap); unset: "
        "every node schedules alone",
        {"action": "store_true"},
    ),
    Flag(
        "--check-invariants",
        "check sum-weight mass and sum of w*x at every round; O(N) per round",
        {"action": "store_true"},
    ),
    Flag(
        "--plot",
        "write a PNG of error (or accuracy) against virtual time",
        {"default": None},
    ),
    Flag(
        "--json",
        "table to stderr, one JSON object as the last stdout line",
        {"action": "store_true"},
    ),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``gossipd sim`` (:data:`FLAGS`); every help text names its default."""
    for flag in FLAGS:
        options = dict(flag.options)
        if flag.choices is not None:
            options["choices"] = flag.choices()
        p.add_argument(flag.name, **options, help=f"{flag.help} (default: {flag.shown_default})")


def spec_from_args(args: argparse.Namespace) -> SimSpec:
    from gossipd.node.sim.spec import SimSpec

    faults = tuple(
        parse_fault(kind, text) for kind, _ in FAULT_KINDS for text in getattr(args, kind)
    )
    scenario = load_scenario(args.scenario)
    if faults or args.loss is not None:
        scenario = scenario.with_faults(faults, args.loss)
    return SimSpec(
        protocol=args.protocol,
        nodes=args.nodes,
        rounds=args.rounds,
        segments=args.segments,
        scenario=scenario,
        seed=args.seed,
        payload=args.payload,
        dim=args.dim,
        model_bytes=args.model_bytes,
        round_steps=args.round_steps,
        max_in_flight=args.max_in_flight,
        weight_balance=args.weight_balance,
        peer_credit=args.peer_credit,
        codec=args.codec,
        error_feedback=args.error_feedback,
        feedback_peers=args.feedback_peers,
        topk_fraction=args.topk_fraction,
        options=protocol_options(args),
        learning_rate=args.learning_rate,
        target_error=args.target_error,
        predict=args.predict,
        check_invariants=args.check_invariants,
        coordinator=args.coordinator,
    )


def parse_setting(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` (a ``--set``): the value read as TOML (``1``, ``0.5``, ``true``,
    ``"x"``), or as a plain string when it is not TOML."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: write it as KEY=VALUE, e.g. push_probability=1")
    try:
        return key.strip(), tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return key.strip(), value


def checked_options(protocol: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options``, after the protocol's own class found them valid (ConfigError if not)."""
    try:
        protocol_settings(protocol, options)
    except ValidationError as err:
        known = settings_class(protocol).model_fields
        raise ConfigError(explain(protocol, err, known)) from None
    return options


def protocol_options(args: argparse.Namespace) -> dict[str, Any]:
    """The protocol's own settings: ``--set``, and the deprecated flags where it has them."""
    options = dict(parse_setting(text) for text in args.set)
    takes = settings_class(args.protocol).model_fields
    deprecated = {
        "push_probability": args.push_probability,
        "average_every_steps": args.average_every_steps or None,
    }
    for key, value in deprecated.items():
        if value is None or key not in takes:
            continue  # as before: a flag the protocol does not use is ignored
        if key in options:
            raise ConfigError(f"--{key.replace('_', '-')} and --set {key} both given: keep --set")
        options[key] = value
    return checked_options(args.protocol, options)


def run(args: argparse.Namespace) -> int:
    from gossipd.node.sim.driver import Simulation

    spec = spec_from_args(args)
    progress = Progress(spec.rounds)
    try:
        result = Simulation(spec, on_probe=progress).run()
    finally:
        progress.close()
    out = sys.stderr if args.json else sys.stdout
    print_table(result, spec, out)
    if args.plot:
        print(f"plot: {plot_result(result, Path(args.plot))}", file=out)
    if args.json:
        data = result.as_dict()
        data["scenario_description"] = spec.scenario.description
        print(json.dumps(data))
    return 0
