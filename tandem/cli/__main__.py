"""`python -m tandem.cli ...`: the `tandem` command, as `tandem up` starts its children."""

import sys

from tandem.cli.main import main

sys.exit(main())
