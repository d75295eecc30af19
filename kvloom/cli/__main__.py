from kvloom.cli.main import main

raise SystemExit(main())
