import sys

from strop.cli.main import main

sys.exit(main())
