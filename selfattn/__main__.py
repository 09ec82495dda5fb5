import sys

from selfattn.cli import main

sys.exit(main())
