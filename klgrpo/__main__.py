from klgrpo.cli import main

raise SystemExit(main())
