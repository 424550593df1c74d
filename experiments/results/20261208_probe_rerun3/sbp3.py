"""Sandbox probe, new cases S23-S32 (PythonTool as the calling user; 60 threads alive).
Run as root: PYTHONPATH=<checkout> python sbp3.py; as nobody: through
tests.reliability.unprivileged.run(open('sbp3.py').read())."""
import os, threading, time
stop = threading.Event()
ths = [threading.Thread(target=stop.wait, daemon=True) for _ in range(60)]
[t.start() for t in ths]
print("uid", os.getuid(), "threads", threading.active_count(), flush=True)
from hybridjax.tools.sandbox import PythonTool
tool = PythonTool({"timeout_s": 8, "memory_mb": 256, "max_processes": 16, "max_file_mb": 16, "max_open_files": 64})
def avail():
    return int([l for l in open("/proc/meminfo") if l.startswith("MemAvailable")][0].split()[1]) >> 10
def run(name, code):
    a0 = avail(); t0 = time.time(); low = [a0]; done = threading.Event()
    def watch():
        while not done.is_set():
            low[0] = min(low[0], avail()); time.sleep(0.05)
    w = threading.Thread(target=watch); w.start()
    try:
        out = tool.execute({"code": code}); res = "OK: " + out.strip().replace("\n", " | ")[-400:]
    except Exception as e:
        res = f"ERR {type(e).__name__}: {str(e)[:300]}"
    done.set(); w.join()
    print(f"[{name}] {time.time()-t0:.1f}s dip {a0 - low[0]} MiB; {res}", flush=True)
run("baseline", "print(1+1)")
run("S23 fallocate 1 GB in /work", """
import os
fd = os.open('/work/big', os.O_CREAT | os.O_WRONLY)
try:
    os.posix_fallocate(fd, 0, 1 << 30); print('allocated', os.fstat(fd).st_size)
except OSError as e:
    print('refused', e.strerror)
""")
run("S24 sparse file on /dev/shm, mmap MAP_SHARED, touch 200 MB", """
import mmap, os
fd = os.open('/dev/shm/sp', os.O_CREAT | os.O_RDWR); os.ftruncate(fd, 400 << 20)
m = mmap.mmap(fd, 400 << 20)
try:
    for i in range(0, 200 << 20, 4096): m[i] = 1
    print('touched 200 MB')
except Exception as e:
    print('stopped', type(e).__name__, e)
""")
run("S25 kernel keyrings: read the session / user keyring", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
for name, kid in (('session', -3), ('user', -4), ('process', -2)):
    buf = ctypes.create_string_buffer(4096)
    r = libc.syscall(250, 11, kid, buf, 4096)  # keyctl(KEYCTL_READ)
    print(name, r, os.strerror(ctypes.get_errno()) if r < 0 else buf.raw[:r])
""")
run("S26 io_uring_setup, userfaultfd, perf_event_open, bpf", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
params = ctypes.create_string_buffer(120)
for name, nr, args in (('io_uring_setup', 425, (8, params)), ('userfaultfd', 323, (0,)), ('perf_event_open', 298, (ctypes.create_string_buffer(128), 0, -1, -1, 0)), ('bpf', 321, (0, ctypes.create_string_buffer(64), 64))):
    r = libc.syscall(nr, *args); print(name, r, os.strerror(ctypes.get_errno()) if r < 0 else 'allowed')
""")
run("S27 SIGSTOP the sandbox's init (pid 1) and itself", """
import os, signal
print('pid', os.getpid(), flush=True)
try:
    os.kill(1, signal.SIGSTOP)
except OSError as e:
    print('kill 1:', e.strerror, flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
print('resumed')
""")
run("S28 1 GB to stderr in one write, no newline", "import sys; sys.stderr.write('e' * (1 << 30)); print('wrote')")
run("S29 15 threads (under max_processes=16) with the caller's 60 alive", """
import threading
ts = [threading.Thread(target=lambda: None) for _ in range(12)]
[t.start() for t in ts]; [t.join() for t in ts]; print('12 threads ok')
""")
run("S30 4 threads burning CPU past the timeout", """
import threading
def burn():
    while True: pass
[threading.Thread(target=burn, daemon=True).start() for _ in range(4)]
burn()
""")
run("S31 a child that closes stdout, keeps stderr, and outlives the code (bwrap)", """
import os, sys, time
if os.fork() == 0:
    os.setsid(); os.close(1); time.sleep(60); os._exit(0)
print('parent done')
""")
run("S32 inotify and fanotify on /", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.inotify_init1(0); print('inotify', fd, libc.inotify_add_watch(fd, b'/', 0xfff))
r = libc.fanotify_init(0, 0); print('fanotify', r, os.strerror(ctypes.get_errno()) if r < 0 else 'allowed')
""")
run("after", "print(2+2)")
stop.set()
