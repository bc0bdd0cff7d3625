"""The commands: ``klgrpo train | verify-kl | report | sweep`` (cli.py dispatches) and the embedded demo."""
