import sys

from strop.gateways.tinker.server import main

sys.exit(main())
