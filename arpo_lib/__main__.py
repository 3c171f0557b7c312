from arpo_lib.cli import main

raise SystemExit(main())
