"""docs/cli.md, rendered from the CLI's own parser: `python -m streamspec_ray.clidoc > docs/cli.md`.

tests/test_docs.py checks that the committed file equals this rendering, so the reference cannot drift from
`streamspec --help`."""
from __future__ import annotations

import argparse

WIDTH = 110  # fixed, so the text does not depend on the terminal that renders it

HEADER = """# `streamspec` command reference

Generated from the parser (`python -m streamspec_ray.clidoc > docs/cli.md`); `tests/test_docs.py` fails when
this file and `streamspec --help` disagree. `python -m streamspec_ray` is the same program. Errors are one
`error: ...` line on stderr and a non-zero exit; `--debug` (before or after the subcommand) shows tracebacks.
"""


def _help(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)
    return parser.format_help().rstrip()


def render() -> str:
    from .cli_args import build_parser

    top = build_parser()
    sub = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    parts = [HEADER, "```text\n" + _help(top) + "\n```\n"]
    for name, parser in sub.choices.items():
        parts.append(f"## `streamspec {name}`\n\n```text\n{_help(parser)}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
