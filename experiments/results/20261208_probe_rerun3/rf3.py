# reward functions of the K cases (lived in /tmp/pr3/k/rw/rf3.py)
import os, signal, sys, threading, time
import numpy as np

def _daemon(tag):
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            with open(f"/tmp/pr3/k/daemon_{tag}_{os.getpid()}", "w"):
                pass
            time.sleep(600)
        os._exit(0)
    os.wait()

def daemon2(data_source, solution_str, ground_truth, extra_info=None):
    _daemon("d2")  # K38: the K22 daemon, double-forked
    return 1.0

def deaf_daemon(data_source, solution_str, ground_truth, extra_info=None):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # K33: the worker ignores SIGTERM
    _daemon("deaf")
    return 1.0

def array1(data_source, solution_str, ground_truth, extra_info=None):
    return np.array([1.0])  # K31

def thread_forever(data_source, solution_str, ground_truth, extra_info=None):
    threading.Thread(target=time.sleep, args=(3600,)).start()  # K32: non-daemon thread
    return 1.0

class Scorer:  # K35: a class where a function belongs
    def __init__(self, data_source, solution_str, ground_truth, extra_info=None):
        pass

def hold_stdout(data_source, solution_str, ground_truth, extra_info=None):
    # K39: a plain background child (no setsid) that keeps stdout and sleeps
    if os.fork() == 0:
        time.sleep(600)
        os._exit(0)
    return 1.0
