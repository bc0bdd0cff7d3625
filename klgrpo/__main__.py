from klgrpo.apps.cli import main

raise SystemExit(main())
