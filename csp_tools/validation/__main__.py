"""python3 -m csp_tools.validation --nodes=N --nodelist=LIST --partition=P: see run.py."""

import sys

from csp_tools.validation.run import main

sys.exit(main())
