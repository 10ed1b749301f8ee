"""python -m client generate|bench|health ... (the same commands as `pagedserve generate|bench|health ...`)."""

import sys

from client.commands import main

if __name__ == "__main__":
    sys.exit(main())
