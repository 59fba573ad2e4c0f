from llmcluster.distributed.loopback import install

# a local run's ranks (and an ft group's agent): every TCPStore on 127.0.0.1, before torchft binds the class
install()

from llmcluster.cli import main

raise SystemExit(main())
