import os, socket, subprocess, sys, time, threading, json
PORT = 8931
env = dict(os.environ, HYBRIDJAX_REWARD_TOKEN="s3cret", PYTHONPATH="/work/wt/probe")
srv = subprocess.Popen(["nice", "-n", "19", "/work/main/.venv/bin/python", "-m", "hybridjax.rewards.serve",
                        "--port", str(PORT), "--num_workers", "1", "--max_request_bytes", "1000000",
                        "--body_timeout_s", "3", "--reward_kwargs", '{"api_key": "TOPSECRET"}'],
                       env=env, stdout=open("srv.log", "w"), stderr=subprocess.STDOUT)
def rss():
    # the server's python process (child of nice exec: same pid)
    s = open(f"/proc/{srv.pid}/status").read()
    return {l.split(":")[0]: l.split(":")[1].strip() for l in s.splitlines() if l.startswith(("VmRSS", "VmHWM"))}
def raw(data, read=True, timeout=10):
    s = socket.create_connection(("127.0.0.1", PORT), timeout=timeout)
    try:
        s.sendall(data)
        if not read: return s
        out = b""
        while True:
            try:
                c = s.recv(65536)
            except socket.timeout:
                return out.decode(errors="replace") + " <TIMEOUT>"
            except ConnectionResetError:
                return out.decode(errors="replace") + " <RESET>"
            if not c: break
            out += c
        return out.decode(errors="replace")
    finally:
        if read: s.close()
for _ in range(120):
    try:
        socket.create_connection(("127.0.0.1", PORT), timeout=1).close(); break
    except OSError: time.sleep(0.5)
print("up", rss())
def first(r): 
    lines = r.split("\r\n"); return lines[0] + " | " + lines[-1][:200]
def req(method, path, headers, body=b""):
    h = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"{method} {path} HTTP/1.1\r\nHost: x\r\n{h}\r\n".encode() + body
case = sys.argv[1:] or ["all"]
B = "Bearer s3cret"
print("R-routes wrong token:")
for m, p in [("POST", "/score"), ("POST", "/score_tokens"), ("POST", "/judge"), ("GET", "/health"), ("GET", "/docs"),
             ("GET", "/openapi.json"), ("HEAD", "/health"), ("OPTIONS", "/score"), ("GET", "/%68ealth"), ("GET", "/health/"), ("GET", "//health"),
             ("POST", "/health")]:
    r = raw(req(m, p, {"Authorization": "Bearer wrong", "Content-Length": "2", "Connection": "close"}, b"{}"))
    print(f"  {m} {p}: {first(r)}")
print("R-neg CL:", first(raw(req("POST", "/score", {"Authorization": B, "Content-Length": "-5", "Connection": "close"}, b"{}"))))
print("R-huge CL:", first(raw(req("POST", "/score", {"Authorization": B, "Content-Length": "99999999999999999999999", "Connection": "close"}, b"{}"))))
print("R-dup CL:", first(raw(req("POST", "/score", {"Authorization": B, "Content-Length": "2", "content-length": "900", "Connection": "close"}, b"{}"))))
print("R-chunked wrong token:", first(raw(req("POST", "/score", {"Authorization": "Bearer x", "Transfer-Encoding": "chunked", "Connection": "close"}, b"2\r\n{}\r\n0\r\n\r\n"))))
print("R-chunked right token, no CL:", first(raw(req("POST", "/score", {"Authorization": B, "Transfer-Encoding": "chunked", "Connection": "close"}, b"2\r\n{}\r\n0\r\n\r\n"))))
print("rss", rss())
# CL small + chunked large (authenticated): does the server read past max_request_bytes?
def cl_te(n_mb):
    s = raw(req("POST", "/score", {"Authorization": B, "Content-Length": "10", "Transfer-Encoding": "chunked"}), read=False, timeout=30)
    chunk = b"x" * (1 << 20)
    try:
        for _ in range(n_mb):
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        s.sendall(b"0\r\n\r\n")
        out = s.recv(4096).decode(errors="replace")
    except OSError as e:
        out = f"<{type(e).__name__}>"
    s.close(); return out
print("R-CL+TE 200MB:", cl_te(200).split("\r\n")[0], rss())
# slowloris body
t0 = time.time()
s = raw(req("POST", "/score", {"Authorization": B, "Content-Length": "1000"}, b"{"), read=False, timeout=20)
try:
    while time.time() - t0 < 15:
        s.sendall(b" "); time.sleep(0.5)
    out = "<still open after 15 s>"
except OSError as e:
    out = f"dropped after {time.time()-t0:.1f}s ({type(e).__name__})"
try: out += " | " + s.recv(4096).decode(errors="replace").split("\r\n")[0]
except OSError: pass
print("R-trickle body:", out)
# slow headers: 200 connections sending partial headers, then check health still answers
socks = []
for i in range(200):
    try:
        c = socket.create_connection(("127.0.0.1", PORT), timeout=5); c.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n"); socks.append(c)
    except OSError as e:
        print("conn fail", i, e); break
t0 = time.time()
print("R-200 half-headers then health:", first(raw(req("GET", "/health", {"Connection": "close"}))), f"{time.time()-t0:.2f}s")
time.sleep(8)
alive = 0
for c in socks:
    try:
        c.sendall(b"X: y\r\n"); c.settimeout(0.01); 
        try: d = c.recv(1)
        except socket.timeout: alive += 1; continue
        if d: alive += 1
    except OSError: pass
print("  half-header conns still open after 8s:", alive, "/", len(socks))
for c in socks: c.close()
# unauthenticated GET /health with big bodies x6 concurrently
def big_health():
    try:
        s = socket.create_connection(("127.0.0.1", PORT), timeout=20)
        s.sendall(req("GET", "/health", {"Content-Length": str(46_000_000)}))
        blk = b"a" * (1 << 20)
        for _ in range(44): s.sendall(blk)
        s.close()
    except OSError as e:
        pass
th = [threading.Thread(target=big_health) for _ in range(6)]
[t.start() for t in th]; [t.join() for t in th]
print("R-6x46MB GET /health unauth:", rss())
print("health auth:", raw(req("GET", "/health", {"Authorization": B, "Connection": "close"})).split("\r\n")[-1][:300])
srv.terminate(); srv.wait(20)
print("server exit", srv.returncode)
