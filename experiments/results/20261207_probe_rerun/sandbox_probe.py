import os, threading, time, json
os.environ["HF_TOKEN"] = "hf_SECRET_OF_TRAINER"
stop = threading.Event()
ths = [threading.Thread(target=stop.wait, daemon=True) for _ in range(60)]
[t.start() for t in ths]
print("uid", os.getuid(), "threads", threading.active_count())
from hybridjax.tools.sandbox import PythonTool
tool = PythonTool({"timeout_s": 5, "memory_mb": 256, "max_processes": 16, "max_file_mb": 16})
def run(name, code):
    t0 = time.time()
    try:
        out = tool.execute({"code": code}); res = "OK: " + out.strip().replace("\n", " | ")[:400]
    except Exception as e:
        res = f"ERR {type(e).__name__}: {str(e)[:300]}"
    print(f"[{name}] {time.time()-t0:.1f}s {res}", flush=True)
run("baseline", "print(1+1)")
run("S1 fork bomb", """
import os
n=0
try:
    while True:
        if os.fork()==0:
            import time; time.sleep(30); os._exit(0)
        n+=1
except OSError as e:
    print('forks', n, type(e).__name__)
""")
run("S1b thread bomb", """
import threading, time
n=0
try:
    while True:
        threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); n+=1
except Exception as e:
    print('threads', n, type(e).__name__)
""")
run("S2 /proc reads", """
import os
print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))
for p in ['/proc/1/environ', '/proc/self/environ']:
    try: print(p, open(p,'rb').read()[:200])
    except Exception as e: print(p, type(e).__name__)
print('mounts', len(open('/proc/self/mountinfo').read().splitlines()))
for p in ['/proc/1/root/etc/passwd', '/proc/self/root/root', '/etc/passwd', '/root', '/work/wt/probe/README.md', '/tmp/pr/run1']:
    try: print(p, 'READ', os.listdir(p)[:3] if os.path.isdir(p) else open(p).read()[:40])
    except Exception as e: print(p, type(e).__name__)
print('env', dict(os.environ))
""")
run("S3 write past tmpfs (many 8MB files)", """
import os
for d in ['/work', '/tmp', '/dev/shm']:
    n=0
    try:
        for i in range(100):
            with open(f'{d}/f{i}','wb') as f: f.write(b'x'*(8<<20))
            n+=1
    except OSError as e:
        print(d, 'files', n, e.strerror)
    else:
        print(d, 'wrote', n*8, 'MB')
""")
run("S3b one big file", "open('/work/big','wb').write(b'x'*(64<<20)); print('wrote')")
run("S4 symlink escape", """
import os
os.symlink('/proc/1/root/../../../../etc', '/work/esc')
for p in ['/work/esc/passwd', '/work/esc/shadow']:
    try: print(p, open(p).read()[:30])
    except Exception as e: print(p, type(e).__name__)
import sys
try:
    open(os.path.join(sys.prefix, 'pwned.txt'), 'w').write('x'); print('WROTE prefix')
except Exception as e: print('prefix', type(e).__name__)
try:
    open('/usr/pwned','w'); print('WROTE /usr')
except Exception as e: print('/usr', type(e).__name__)
""")
run("S5 memory 8 children x 100MB", """
import os, time
pids=[]
for i in range(8):
    p=os.fork()
    if p==0:
        b=bytearray(100<<20)
        for j in range(0,len(b),4096): b[j]=1
        time.sleep(3); os._exit(0)
    pids.append(p)
for p in pids: print(os.waitpid(p,0)[1], end=' ')
print('done')
""")
run("S6 network + kill host", """
import socket, os, signal
try:
    socket.create_connection(('127.0.0.1', 22), timeout=1); print('CONNECTED 22')
except Exception as e: print('net', type(e).__name__)
try:
    socket.create_connection(('8.8.8.8', 53), timeout=1); print('CONNECTED out')
except Exception as e: print('netout', type(e).__name__)
try: os.kill(%d, signal.SIGTERM); print('KILLED host')
except Exception as e: print('kill', type(e).__name__)
""" % os.getppid())
run("S7 timeout + daemonised child", """
import os, time
if os.fork()==0:
    os.setsid()
    if os.fork()==0:
        open('/tmp/alive','w'); time.sleep(1000)
    os._exit(0)
time.sleep(100)
""")
run("after", "import os; print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
stop.set()
