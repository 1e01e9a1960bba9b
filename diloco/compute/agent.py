"""The torchrun agent of a learner of several ranks (`diloco compute --nproc N` runs
`python -m diloco.compute.agent ...`): torch's own launcher, whose failure ends in one line naming
the rank, instead of its traceback and failure table. Each rank's own error is in the log above it
(rank 0's in one line, as any learner's: a refusal at join, a model the run cannot take)."""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def exit_code(returned: int) -> int:
    """A rank's exit status as a process's: a signal (negative) as 128 + its number."""
    return returned if returned > 0 else 128 - returned if returned < 0 else 1


def main(argv: list[str]) -> int:
    # torchrun's own default, set here so it does not print its banner about it: each rank sets
    # its threads itself (train.threads, --threads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = exit_code(failure.exitcode)
        print(f"the learner's group stopped: rank {rank} ended first, with exit code {code}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
