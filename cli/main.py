"""`exspec` command line: one subcommand per module, each with `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that implements it (imported only when that subcommand runs)
COMMANDS = {
    "serve": ("exspec.cli.serve", "run the OpenAI-compatible HTTP server"),
    "generate": ("exspec.cli.generate", "offline batch generation from a JSONL file"),
    "demo-models": ("exspec.cli.demo", "build the built-in demo target/draft pair (offline)"),
    "bench": ("exspec.cli.bench", "offline throughput benchmark against plain decoding and peers"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """All subcommands are listed; only `command`'s module is imported to add its flags."""
    from exspec import __version__

    parser = argparse.ArgumentParser(prog="exspec", description="Batched speculative decoding done right.")
    parser.add_argument("--version", action="version", version=f"exspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == command:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(next((a for a in argv if a in COMMANDS), None))
    args = parser.parse_args(argv)
    from exspec.errors import ExspecError

    try:
        return importlib.import_module(args._module).run(args) or 0
    except ExspecError as e:
        print(f"exspec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
