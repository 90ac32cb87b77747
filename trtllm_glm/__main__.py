"""``python -m trtllm_glm`` runs the ``trtllm-glm`` command line."""

import sys

from .cli import main

sys.exit(main())
