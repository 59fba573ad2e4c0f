from llmcluster.cli import main

raise SystemExit(main())
