"""`python -m radixlm.runtime.server --model M --port 30000` (same flags as `radixlm serve`)."""

import sys

from radixlm.runtime.server.launch import main

if __name__ == "__main__":
    sys.exit(main())
