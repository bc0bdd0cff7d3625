"""``python -m klgrpo.apps.explain``: the same as ``klgrpo explain``."""

from klgrpo.apps.explain.command import main

raise SystemExit(main())
