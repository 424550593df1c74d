"""Sandbox probe, new cases S12-S24 (PythonTool as the calling user; 60 threads alive)."""
import os, threading, time, sys
os.environ["HF_TOKEN"] = "hf_SECRET_OF_TRAINER"
stop = threading.Event()
ths = [threading.Thread(target=stop.wait, daemon=True) for _ in range(60)]
[t.start() for t in ths]
print("uid", os.getuid(), "threads", threading.active_count(), flush=True)
from hybridjax.tools.sandbox import PythonTool
tool = PythonTool({"timeout_s": 8, "memory_mb": 256, "max_processes": 16, "max_file_mb": 16, "max_open_files": 64})
# an fd the caller leaks on purpose (inheritable), pointing at a file the sandbox must not read
secret = "/tmp/sbp2_secret.txt"
with open(secret, "w") as f: f.write("TOPSECRET-FILE")
os.chmod(secret, 0o644)
fd = os.open(secret, os.O_RDONLY); os.set_inheritable(fd, True)
def avail():
    return int([l for l in open("/proc/meminfo") if l.startswith("MemAvailable")][0].split()[1]) >> 10
def run(name, code):
    a0 = avail(); t0 = time.time()
    low = [a0]
    def watch():
        while not done.is_set():
            low[0] = min(low[0], avail()); time.sleep(0.05)
    done = threading.Event(); w = threading.Thread(target=watch); w.start()
    try:
        out = tool.execute({"code": code}); res = "OK: " + out.strip().replace("\n", " | ")[:500]
    except Exception as e:
        res = f"ERR {type(e).__name__}: {str(e)[:300]}"
    done.set(); w.join()
    print(f"[{name}] {time.time()-t0:.1f}s host MemAvailable dip {a0 - low[0]} MiB; {res}", flush=True)
run("baseline", "print(1+1)")
run("S12 shell fork bomb", "import subprocess; r = subprocess.run(['/bin/sh', '-c', 'f(){ f | f & }; f; sleep 2; echo done'], capture_output=True, text=True, timeout=6); print(r.returncode, r.stdout[-100:], r.stderr[-200:].replace(chr(10), ' / '))")
run("S13 tmp fill with empty files (inodes)", """
import os, time
t0 = time.time(); n = 0
try:
    while time.time() - t0 < 4:
        open(f'/tmp/{n}', 'w').close(); n += 1
except OSError as e:
    print('stopped', e.strerror)
print('empty files', n)
""")
run("S14 memfd: 40 x 15 MB held by fds, unmapped (600 MB > memory_mb 256)", """
import os
fds = []
try:
    for i in range(40):
        fd = os.memfd_create(f'm{i}')
        os.ftruncate(fd, 15 << 20)
        for _ in range(15): os.write(fd, b'x' * (1 << 20))
        fds.append(fd)
except OSError as e:
    print('stopped', type(e).__name__, e)
print('memfds', len(fds), 'MB', len(fds) * 15)
import time; time.sleep(2)
""")
run("S15 nested user+mount namespace, a fresh tmpfs, 25 x 15 MB files (375 MB > 256)", """
import os, ctypes
libc = ctypes.CDLL(None, use_errno=True)
try:
    uid0 = os.getuid()
    if libc.unshare(0x10000000 | 0x00020000) != 0: raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    print('unshare ok')
    uid, gid = 65534, 65534
    open('/proc/self/setgroups', 'w').write('deny')
    open('/proc/self/uid_map', 'w').write(f'0 {uid} 1')
    open('/proc/self/gid_map', 'w').write(f'0 {gid} 1')
except OSError as e:
    print('unshare refused', e); raise SystemExit
os.makedirs('/tmp/m', exist_ok=True)
r = libc.mount(b'none', b'/tmp/m', b'tmpfs', 0, None)
print('mount', r, os.strerror(ctypes.get_errno()) if r else '')
if r == 0:
    n = 0
    try:
        for i in range(25):
            with open(f'/tmp/m/f{i}', 'wb') as f:
                for _ in range(15): f.write(b'x' * (1 << 20))
            n += 1
    except OSError as e:
        print('stopped', e.strerror)
    print('MB written', n * 15)
    import time; time.sleep(2)
""")
run("S16 /proc and /sys", """
import os
for p in ['/sys/class/net', '/sys/fs/cgroup', '/proc/kcore', '/proc/sysrq-trigger', '/proc/self/mountinfo', '/proc/cpuinfo', '/proc/net/unix', '/proc/sys/kernel/hostname', '/sys/kernel/mm', '/proc/1/cmdline']:
    try:
        if os.path.isdir(p): print(p, 'dir', sorted(os.listdir(p))[:4])
        else: d = open(p, 'rb').read(200); print(p, 'read', len(d), d[:60])
    except Exception as e: print(p, type(e).__name__)
for p, v in [('/proc/sys/kernel/hostname', b'x'), ('/proc/sysrq-trigger', b'h'), ('/proc/sys/vm/drop_caches', b'3')]:
    try: open(p, 'wb').write(v); print('WROTE', p)
    except Exception as e: print('write', p, type(e).__name__)
""")
run("S17 network: abstract unix sockets, netlink, raw sockets, ipv6, listen", """
import socket, os
print('ifaces', socket.if_nameindex())
for addr in ['\\0/tmp/.X11-unix/X0', '\\0hybridjax', '\\0containerd-shim']:
    s = socket.socket(socket.AF_UNIX); 
    try: s.connect(addr); print('CONNECTED', addr)
    except OSError as e: print('unix', repr(addr[:12]), e.strerror)
for fam, typ, proto in [(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP), (socket.AF_PACKET, socket.SOCK_RAW, 0), (socket.AF_NETLINK, socket.SOCK_RAW, 0)]:
    try: socket.socket(fam, typ, proto); print('opened', fam, typ)
    except OSError as e: print('socket', fam, e.strerror)
for host in [('::1', 22), ('2001:4860:4860::8888', 53)]:
    try: socket.create_connection(host, timeout=1); print('CONNECTED', host)
    except OSError as e: print('connect', host, e.strerror or e)
s = socket.socket(); s.bind(('0.0.0.0', 8080)); s.listen(); print('listening on 8080 inside')
""")
run("S18 inherited fds and stdin", f"""
import os, sys
print('fds', sorted(os.listdir('/proc/self/fd')))
for n in range(3, 40):
    try: print('READ fd', n, os.read(n, 50))
    except OSError: pass
try: print('stdin', repr(sys.stdin.read(50)) if sys.stdin else None)
except Exception as e: print('stdin', type(e).__name__)
try: print('via /proc', open('/proc/self/fd/{fd}').read())
except Exception as e: print('via /proc fd {fd}', type(e).__name__)
""")
run("S19 symlink escapes", """
import os
for name, target in [('a', '/proc/1/cwd'), ('b', '/proc/self/root/..'), ('c', '/proc/1/root'), ('d', '../../../../..')]:
    os.symlink(target, '/work/' + name)
    try: print(name, sorted(os.listdir('/work/' + name))[:6])
    except Exception as e: print(name, type(e).__name__)
try: os.link('/usr/bin/env', '/work/h'); print('HARDLINK /usr/bin/env made')
except OSError as e: print('hardlink', e.strerror)
""")
run("S20 raise rlimits / setuid / ptrace of init", """
import resource, os, ctypes
for r in [resource.RLIMIT_NPROC, resource.RLIMIT_AS, resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE, resource.RLIMIT_CPU]:
    s, h = resource.getrlimit(r)
    try: resource.setrlimit(r, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)); print('RAISED', r)
    except (ValueError, OSError) as e: print('rlimit', r, (s, h), 'kept')
try: os.setuid(0); print('SETUID 0')
except OSError as e: print('setuid', e.strerror)

""")
run("S21 memory via 12 children x 30 MB mmap shared-anon each touched by 2 procs", """
import os, mmap, time
kids = []
for i in range(12):
    pid = os.fork()
    if pid == 0:
        m = mmap.mmap(-1, 30 << 20); m.write(b'x' * (30 << 20))
        if os.fork() == 0:
            m[0:1] = b'y'; time.sleep(6); os._exit(0)
        time.sleep(6); os._exit(0)
    kids.append(pid)
for p in kids: os.waitpid(p, 0)
print('children done')
""")
run("after", "print('still works')")
stop.set()
run("S22 SysV shm: 6 x 100 MB segments, touched then detached (600 MB > 256)", """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
n = 0
for i in range(6):
    sid = libc.shmget(0, 100 << 20, 0o1600)
    if sid < 0: print('shmget', os.strerror(ctypes.get_errno())); break
    addr = libc.shmat(sid, None, 0)
    if addr in (None, ctypes.c_void_p(-1).value): print('shmat', os.strerror(ctypes.get_errno())); break
    ctypes.memset(addr, 1, 100 << 20); libc.shmdt(ctypes.c_void_p(addr)); n += 1
print('segments', n)
import time; time.sleep(3)
""")
stop.set()
