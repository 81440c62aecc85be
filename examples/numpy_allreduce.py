"""The smallest ringflow job: every rank contributes rank+1; everyone checks the closed form.

    ringflow-run -np 3 python examples/numpy_allreduce.py
"""

import numpy as np

import ringflow as rf

rf.init()
r, n = rf.rank(), rf.size()
total = rf.allreduce(np.full(1_000_003, r + 1, np.float64), name="demo", op=rf.Sum)
expected = n * (n + 1) / 2
if not np.all(total == expected):
    raise SystemExit(f"rank {r}: got {total[:3]}, expected {expected}")
gathered = rf.allgather(np.full((r + 1, 2), r))
print(f"rank {r}/{n}: allreduce sum = {total[0]:g} (expected {expected:g}); "
      f"allgather rows = {gathered.shape[0]}")
rf.shutdown()
