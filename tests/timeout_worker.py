"""A worker for tests/test_distributed.py: `torchrun --nproc_per_node 2 tests/timeout_worker.py TIMEOUT_S DELAY_S`.

Rank 1 spends DELAY_S seconds on its share of a `shared_map` (as a rank does that samples long responses or waits on
a slow judge) while rank 0 waits at the gather: the run survives iff the group's timeout is longer than the delay."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import parallel


def slow_on_rank_1(share: list, delay: float) -> list:
    if parallel.RANK == 1:
        time.sleep(delay)
    return [x * 10 for x in share]


if __name__ == "__main__":
    timeout, delay = float(sys.argv[1]), float(sys.argv[2])
    parallel.init(timeout)
    result = parallel.shared_map(lambda share: slow_on_rank_1(share, delay), [1, 2, 3, 4])
    assert result == [10, 20, 30, 40], result
    parallel.barrier()
    print(f"rank {parallel.RANK}: gathered {result}", flush=True)
