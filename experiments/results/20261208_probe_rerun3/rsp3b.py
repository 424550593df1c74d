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

def health_t():
    t0 = time.time(); r = raw(req("GET", "/health", {}), timeout=15); return f"{first(r)[:30]} {time.time()-t0:.2f}s"
print("R30b health alone:", health_t(), health_t())
for n, hdr in ((1, GOOD), (10, GOOD), (50, GOOD), (50, BAD), (50, {})):
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", PORT), timeout=10)
        s.sendall(req("POST", "/score", dict(hdr, **{"Content-Length": "100", "Content-Type": "application/json"}), b"{")); socks.append(s)
    time.sleep(0.2)
    print(f"R30b {n} slow bodies {'token' if hdr is GOOD else 'no/bad token'}: health", health_t(), flush=True)
    for s in socks: s.close()
    time.sleep(4)
srv.terminate(); srv.wait(30)
