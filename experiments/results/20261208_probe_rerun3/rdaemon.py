# the reward server's function for R34: forks a setsid daemon (lived in /tmp/pr3/r)
import os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            open(f"/tmp/pr3/r/d_{os.getpid()}", "w").close(); time.sleep(600)
        os._exit(0)
    os.wait()
    return 1.0
