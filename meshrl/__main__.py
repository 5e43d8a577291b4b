"""`python -m meshrl ...` is the `meshrl` command; torchrun starts launchers with `-m meshrl launch`."""

from meshrl.cli import main

main()
