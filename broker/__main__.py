"""Command line of the broker.

    python -m broker --address tcp://127.0.0.1:0 --spool-dir /run/spool --max-staleness 2
    python -m broker export SPOOL --out trajectories.parquet [--steps 3:7]
    python -m broker status tcp://127.0.0.1:5555
    python -m broker keys DIR            # CurveZMQ keys: server, one client, clients/ (allowed)

The serve command prints ``BROKER_ADDRESS <endpoint>`` (and ``BROKER_METRICS_PORT <port>``
with ``--metrics-port``) on stdout once it is bound; broker.process.BrokerProcess reads it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from broker.config import BrokerConfig


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m broker", description="Run the trajectory broker.", allow_abbrev=False
    )  # a misspelt option is an error, not a guess
    ap.add_argument("--config", help="JSON or YAML file with the broker part of a run config")
    fields = BrokerConfig.model_fields
    for name, f in fields.items():
        ap.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=f.description)
    args = ap.parse_args(argv)
    data: dict = {}
    if args.config:
        import yaml

        with open(args.config) as fh:
            data = yaml.safe_load(fh) or {}
    for name in fields:
        if (v := getattr(args, name)) is not None:
            data[name] = None if v.lower() == "none" else v
    from core.configbase import ConfigError, build

    try:
        cfg = build(BrokerConfig, data, prefix="broker.")
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    from broker.server import run_server

    def announce(server, address):
        print(f"BROKER_ADDRESS {address}", flush=True)
        if server.metrics_port is not None:
            print(f"BROKER_METRICS_PORT {server.metrics_port}", flush=True)

    run_server(cfg, on_bound=announce)
    return 0


def _export(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m broker export", description="Export a spool to Parquet.")
    ap.add_argument("spool")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", help="A:B keeps rows admitted for steps A <= step < B")
    args = ap.parse_args(argv)
    steps = None
    if args.steps:
        try:
            a, b = (int(x) for x in args.steps.split(":"))
        except ValueError:
            ap.error(f"--steps must look like A:B with integers, got {args.steps!r}")
        steps = (a, b)
    from broker.spool import export_parquet

    try:
        n = export_parquet(args.spool, args.out, steps)
    except FileNotFoundError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(f"wrote {n} rows to {args.out}")
    return 0


def _status(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m broker status", description="Print a broker's lag metrics.")
    ap.add_argument("address")
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--curve-keys-dir")
    args = ap.parse_args(argv)
    from broker.client import BrokerTimeout, get_status

    try:
        print(json.dumps(get_status(args.address, args.timeout_s, args.curve_keys_dir), indent=2))
    except BrokerTimeout as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0


def _keys(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m broker keys", description="Create CurveZMQ keys.")
    ap.add_argument("dir")
    args = ap.parse_args(argv)
    from broker.process import make_curve_keys

    make_curve_keys(args.dir)
    print(f"keys in {args.dir}: server.key(_secret), client.key(_secret), clients/ (allowed client keys)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    commands = {"export": _export, "status": _status, "keys": _keys}
    if argv and argv[0] in commands:
        return commands[argv[0]](argv[1:])
    return _serve(argv)


if __name__ == "__main__":
    sys.exit(main())
