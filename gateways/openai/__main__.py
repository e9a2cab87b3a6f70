import sys

from strop.gateways.openai.server import main

sys.exit(main())
