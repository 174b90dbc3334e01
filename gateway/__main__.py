"""`python -m gateway`: the `streamgate` command, for where its script is not on the PATH (an engine process)."""

from gateway.cli.commands import main

main()
