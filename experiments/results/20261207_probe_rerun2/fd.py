"""R23: an unauthenticated client holds connections that never finish their headers; with the
server's open-file limit at 256, does it still answer?"""
import os, socket, subprocess, sys, time, json
PORT = int(os.environ.get("PORT", 8933))
env = dict(os.environ, HYBRIDJAX_REWARD_TOKEN="s3cret", PYTHONPATH=os.environ.get("REPO", "/work/wt/probe2"))
srv = subprocess.Popen(["prlimit", "--nofile=256", "nice", "-n", "19", sys.executable, "-m", "hybridjax.rewards.serve",
                        "--port", str(PORT), "--num_workers", "1", *sys.argv[1:]], env=env, stdout=open("fd.log", "w"), stderr=subprocess.STDOUT)
for _ in range(120):
    try: socket.create_connection(("127.0.0.1", PORT), timeout=1).close(); break
    except OSError: time.sleep(0.5)
def health():
    try:
        s = socket.create_connection(("127.0.0.1", PORT), timeout=5)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return s.recv(4096).decode(errors="replace").split("\r\n")[0] or "<closed>"
    except OSError as e:
        return f"<{type(e).__name__}>"
print("before:", health())
socks = []
for i in range(400):
    try:
        s = socket.create_connection(("127.0.0.1", PORT), timeout=2); s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n"); socks.append(s)
    except OSError as e:
        print("client", i, type(e).__name__); break
time.sleep(1)
print("400 half-sent requests held, health:", health(), "| server fds", len(os.listdir(f"/proc/{srv.pid}/fd")))
t0 = time.time()
while time.time() - t0 < 20:
    open_ = 0
    for s in socks:
        try:
            s.setblocking(False); d = s.recv(1)
            if d == b"": continue
        except BlockingIOError:
            open_ += 1
        except OSError: pass
    if open_ == 0: break
    time.sleep(1)
print(f"after {time.time()-t0:.0f} s: {open_} of {len(socks)} held connections still open; health:", health())
for s in socks: s.close()
time.sleep(1); print("released, health:", health())
srv.terminate(); srv.wait(10)
print("log:", open("fd.log").read()[-600:])
