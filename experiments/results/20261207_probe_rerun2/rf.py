import os, signal, sys
def exit0(data_source, solution_str, ground_truth, extra_info=None):
    os._exit(0)
def killself(data_source, solution_str, ground_truth, extra_info=None):
    os.kill(os.getpid(), signal.SIGKILL)
def sysexit_str(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit("bye from reward")
def batch_exit(data_sources, solution_strs, ground_truths, extra_infos, **kw):
    os._exit(7)
def close_stdio(data_source, solution_str, ground_truth, extra_info=None):
    os.close(1); os.close(2); return 1.0
def daemon(data_source, solution_str, ground_truth, extra_info=None):
    if os.fork() == 0:
        os.setsid()
        import time; time.sleep(600); os._exit(0)
    return 1.0
