import sys

from difflet_tpu.bench.cli import main

sys.exit(main())
