"""`python -m meshrun.launcher.export CHECKPOINT OUT [--format meshrun|hf]` (launcher/export/run.py)."""

import sys

from meshrun.launcher.export.run import main

sys.exit(main())
