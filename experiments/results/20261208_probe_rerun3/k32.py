import time, numpy as np
from hybridjax.rewards import RewardConfig, RewardManager
if __name__ == "__main__":
    m = RewardManager(RewardConfig(custom_path="/tmp/pr3/k/rw/rf3.py", custom_name="thread_forever", num_workers=2, timeout_s=5))
    t0 = time.time(); r = m(["a"] * 4, ["s"] * 4, ["a"] * 4, None, np.ones(4, int), 1); print("scored", r.scores, f"{time.time()-t0:.1f}s")
    t0 = time.time(); m.close(); print(f"close {time.time()-t0:.1f}s")
    t0 = time.time()
