from agentruns.cli import main

raise SystemExit(main())
