"""Run at start-up by every Python process whose PYTHONPATH names this folder: the distributed graph tests put it there
for the worker processes they start. With DSASERVE_TEST_REPLAYED_GRAPHS naming a file, the worker replays decode
steps through tests/replayed_graphs.py's stand-in, as the test process does, and logs each replay's host reads
there."""

import os
import sys

if os.environ.get("DSASERVE_TEST_REPLAYED_GRAPHS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import replayed_graphs

    replayed_graphs.install(setattr, os.environ["DSASERVE_TEST_REPLAYED_GRAPHS"])
