"""Reward server probe, new cases R24-R33 (raw sockets; server with a token, 1 MB max, 3 s body deadline)."""
import os, socket, subprocess, sys, time, json, threading
PORT = 8933
REPO = os.environ.get("REPO", "/work/wt/k22probe")
env = dict(os.environ, HYBRIDJAX_REWARD_TOKEN="s3cret", PYTHONPATH=REPO)
srv = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "hybridjax.rewards.serve",
                        "--port", str(PORT), "--num_workers", "1", "--max_request_bytes", "1000000",
                        "--body_timeout_s", "3", "--custom_path", "/tmp/pr3/r/rdaemon.py", "--reward_kwargs", "{\"api_key\": \"KWSECRET\"}"], env=env, stdout=open("srv3.log", "w"), stderr=subprocess.STDOUT)
def rss():
    s = open(f"/proc/{srv.pid}/status").read()
    d = {l.split(":")[0]: l.split(":")[1].strip() for l in s.splitlines() if l.startswith(("VmRSS", "VmHWM"))}
    return f"RSS {d['VmRSS']} peak {d['VmHWM']} fds {len(os.listdir(f'/proc/{srv.pid}/fd'))}"
def raw(data, timeout=10, slow=None):
    s = socket.create_connection(("127.0.0.1", PORT), timeout=timeout)
    try:
        s.sendall(data)
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
    except OSError as e:
        return f"<{type(e).__name__} {e}>"
    finally:
        s.close()
def first(r):
    lines = r.split("\r\n"); return lines[0] + " | " + lines[-1][:160]
def req(method, path, headers, body=b"", ver="HTTP/1.1"):
    h = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"{method} {path} {ver}\r\nHost: x\r\n{h}\r\n".encode() + body
for _ in range(120):
    try:
        socket.create_connection(("127.0.0.1", PORT), timeout=1).close(); break
    except OSError: time.sleep(0.5)
time.sleep(1)
print("start", rss(), flush=True)
GOOD = {"Authorization": "Bearer s3cret"}
BAD = {"Authorization": "Bearer nope"}
rows = json.dumps({"rows": [{"data_source": "x", "solution_str": "a", "ground_truth": "a", "extra_info": None}]}).encode()
def P(name, r): print(f"[{name}] {first(r)}", flush=True)
# R24 wrong token, chunked body of 50 MB
def chunked(n_mb):
    s = socket.create_connection(("127.0.0.1", PORT), timeout=10)
    s.sendall(req("POST", "/score", dict(BAD, **{"Transfer-Encoding": "chunked", "Content-Type": "application/json"})))
    sent = 0
    try:
        chunk = b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n"
        for _ in range(n_mb):
            s.sendall(chunk); sent += 1
    except OSError as e:
        pass
    try:
        out = s.recv(300).decode(errors="replace")
    except OSError as e:
        out = f"<{type(e).__name__}>"
    s.close(); return f"sent {sent} MB; " + out.split("\r\n")[0]
print("[R24 wrong token, 50 MB chunked]", chunked(50), rss(), flush=True)
# R25 HTTP/1.0 without Host; absolute-form target
P("R25a HTTP/1.0 no Host, bad token", raw(b"POST /score HTTP/1.0\r\nAuthorization: Bearer nope\r\nContent-Length: 2\r\n\r\n{}"))
P("R25b absolute-form http://evil/score, bad token", raw(req("POST", "http://evil/score", dict(BAD, **{"Content-Length": "2"}), b"{}")))
P("R25c absolute-form health, no token", raw(req("GET", "http://evil/health", {})))
# R26 /health with the right token
P("R26 /health with token", raw(req("GET", "/health", GOOD)))
# R27 path variants without token
for path in ("/score%00", "/../health", "/health?x=1", "/HEALTH", "/health;x", "/docs/", "/redoc"):
    P(f"R27 {path} no token", raw(req("GET", path, {})))
# R28 gzip bomb with the right token (1 MB -> ~1 GB)
import gzip, io
bomb = gzip.compress(b"\0" * (200 << 20), 9)
P(f"R28 gzip bomb ({len(bomb)} B), token", raw(req("POST", "/score", dict(GOOD, **{"Content-Encoding": "gzip", "Content-Type": "application/json", "Content-Length": str(len(bomb))}), bomb)))
print("   ", rss(), flush=True)
# R29 right token, Content-Length just above the limit, no body sent
t0 = time.time(); P("R29 CL 1000001, no body, token", raw(req("POST", "/score", dict(GOOD, **{"Content-Length": "1000001"})), timeout=8)); print(f"    {time.time()-t0:.1f}s")
# R30 50 concurrent right-token slow bodies, then health
socks = []
for i in range(50):
    s = socket.create_connection(("127.0.0.1", PORT), timeout=10)
    s.sendall(req("POST", "/score", dict(GOOD, **{"Content-Length": "100", "Content-Type": "application/json"}), b"{")); socks.append(s)
t0 = time.time(); P("R30 health during 50 slow bodies", raw(req("GET", "/health", {}), timeout=10)); print(f"    {time.time()-t0:.2f}s")
time.sleep(4.5); closed = 0
for s in socks:
    try:
        s.settimeout(0.5); d = s.recv(200); closed += 1 if (not d or b"408" in d) else 0
    except OSError: closed += 1
    s.close()
print(f"    closed or 408 after 4.5 s: {closed}/50", rss(), flush=True)
# R31 100 pipelined wrong-token requests on one connection
r = raw(b"".join(req("POST", "/score", dict(BAD, **{"Content-Length": "2"}), b"{}") for _ in range(100)), timeout=10)
print(f"[R31 100 pipelined bad-token] 401s: {r.count('401 Unauthorized')}", rss(), flush=True)
# R32 wrong token with CL + TE both (smuggling shape)
P("R32 bad token CL:5 + TE:chunked", raw(req("POST", "/score", dict(BAD, **{"Content-Length": "5", "Transfer-Encoding": "chunked"}), b"0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")))
# R33 header values with NUL / obs-fold / non-ASCII token
P("R33a NUL in token", raw(b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\x00x\r\n\r\n"))
P("R33b obs-fold token", raw(b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer\r\n s3cret\r\n\r\n"))
P("R33c latin-1 token", raw("GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3crét\r\n\r\n".encode("latin-1")))
# R34 a scoring call whose function forks a setsid daemon; then the server is stopped (SIGTERM)
P("R34 score with daemon fn", raw(req("POST", "/score", dict(GOOD, **{"Content-Type": "application/json", "Content-Length": str(len(rows))}), rows)))
print("end", rss(), flush=True)
srv.terminate(); srv.wait(30)
time.sleep(2)
left = [l for l in os.popen("ps -eo pid,args").read().splitlines() if "rdaemon" in l or "forkserver" in l]
print("R34 after SIGTERM of the server: left", len(left), "daemon files", [f for f in os.listdir("/tmp/pr3/r") if f.startswith("d_")])
for f in os.listdir("/tmp/pr3/r"):
    if f.startswith("d_"):
        p = int(f[2:]); print("   daemon", p, "ALIVE" if os.path.exists(f"/proc/{p}") else "gone")
