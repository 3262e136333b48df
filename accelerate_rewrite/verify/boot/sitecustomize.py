"""Put first on PYTHONPATH by the verifier: starts the recording harness in every Python
process of a verified run (the script, and the processes Fabric launches for DDP)."""

import os

if os.environ.get("ACCELERATE_REWRITE_VERIFY"):
    from accelerate_rewrite.verify import harness

    harness.boot()
