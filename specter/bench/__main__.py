import sys

from specter.bench.legacy import main

sys.exit(main())
