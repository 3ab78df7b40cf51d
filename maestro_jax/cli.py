"""`maestro-jax train|verify --config FILE [key=value ...]`.

Thin entry point: parse, validate the config (before JAX starts: it sets the CPU device count),
then call the library. Invalid input exits with status 2 and one `error:` line.
"""

from __future__ import annotations

import argparse
import os
import sys

from maestro_jax.config import ConfigError, load_config


def _ensure_host_devices(n: int) -> None:
    """Give the CPU backend `n` virtual devices when nothing else is asked for (no-op on GPU)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="maestro-jax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("train", "train from a config"), ("verify", "maestro vs monolithic on one batch")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", required=True)
        p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. steps=4")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    _ensure_host_devices(cfg.host_devices)

    from maestro_jax.plan import PlanError  # noqa: PLC0415 (JAX must start after the flags are set)

    try:
        if args.command == "train":
            from maestro_jax.train import train  # noqa: PLC0415

            history = train(cfg)
            print(f"trained {len(history)} steps: loss {history[0]['loss']:.4f} -> {history[-1]['loss']:.4f}")
            return 0
        from maestro_jax.verify import report, verify  # noqa: PLC0415

        text, ok = report(verify(cfg), cfg.verify_rtol)
        print(text)
        return 0 if ok else 1
    except (ConfigError, PlanError) as err:
        msg = str(err)
        print(msg if msg.startswith("error:") else f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
