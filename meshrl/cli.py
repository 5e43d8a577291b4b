"""The `meshrl` command. Each subcommand imports what it needs only once it is chosen.

    meshrl queue serve [...]     run the data plane's controller / storage server
"""

from __future__ import annotations

import sys

USAGE = """usage: meshrl COMMAND [ARGS]

commands:
  queue serve   run the data plane's controller and/or this host's storage server
"""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if args[:2] == ["queue", "serve"]:
        from meshrl.dataplane.serve import main as serve

        serve(args[2:])
        return
    print(USAGE, file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
