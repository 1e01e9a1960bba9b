import os
import time

# The first statement of the process: the end of "process start" in a learner's start-up line
# (diloco.compute.startup), before any import of the CLI, torch or the library.
# Assigned, not defaulted: a child of `diloco run` inherits the supervisor's own value.
os.environ["DILOCO_MAIN_AT"] = repr(time.time())

from cli.main import app  # noqa: E402

app(prog_name="diloco")
