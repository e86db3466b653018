import sys

from eval_worker.cli import main

sys.exit(main())
