"""`python -m launcher.export CHECKPOINT OUT [--format meshrun|hf]` (launcher/export/run.py)."""

import sys

from launcher.export.run import main

sys.exit(main())
