"""Reward server probe, new cases R10-R22 (raw sockets; server with a token, 1 MB max, 3 s body deadline)."""
import os, socket, subprocess, sys, time, json, threading
PORT = 8932
REPO = os.environ.get("REPO", "/work/wt/probe2")
env = dict(os.environ, HYBRIDJAX_REWARD_TOKEN="s3cret", PYTHONPATH=REPO)
srv = subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "hybridjax.rewards.serve",
                        "--port", str(PORT), "--num_workers", "1", "--max_request_bytes", "1000000",
                        "--body_timeout_s", "3"], env=env, stdout=open("srv2.log", "w"), stderr=subprocess.STDOUT)
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
print("up", rss(), flush=True)
GOOD = json.dumps({"rows": [{"data_source": "openai/gsm8k", "solution_str": "#### 3", "ground_truth": "3", "extra_info": {}}]}).encode()
def post(auth, body=GOOD, path="/score", extra={}):
    h = {"Content-Length": str(len(body)), "Connection": "close", "Content-Type": "application/json"}
    if auth is not None: h["Authorization"] = auth
    h.update(extra)
    return first(raw(req("POST", path, h, body)))
print("R10 baseline right token:", post("Bearer s3cret"))
for a in ["bearer s3cret", "BEARER s3cret", "Bearer  s3cret", "Bearer s3cret ", "Bearer s3cretX", "Bearer s3cre", "Basic czNjcmV0", "s3cret", "Bearer S3CRET"]:
    print(f"R10 Authorization {a!r}:", post(a))
print("R10 header name case 'AUTHORIZATION: Bearer wrong':", first(raw(req("POST", "/score", {"AUTHORIZATION": "Bearer wrong", "Content-Length": str(len(GOOD)), "Connection": "close"}, GOOD))))
print("R10 two Authorization headers (wrong, then right):", first(raw(b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nAuthorization: Bearer s3cret\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(GOOD) + GOOD)))
print("R10 two Authorization headers (right, then wrong):", first(raw(b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer s3cret\r\nAuthorization: Bearer wrong\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(GOOD) + GOOD)))
for q in ["/score?token=s3cret", "/score?access_token=s3cret", "/score?authorization=Bearer%20s3cret"]:
    print(f"R11 token in query {q}:", post(None, path=q))
print("R11 token in Cookie:", post(None, extra={"Cookie": "token=s3cret"}))
print("R11 token in X-Api-Key:", post(None, extra={"X-Api-Key": "s3cret"}))
# R12 huge headers, unauthenticated
for n in [20_000, 200_000, 5_000_000]:
    t0 = time.time()
    r = raw(req("POST", "/score", {"X-Big": "a" * n, "Content-Length": "2", "Connection": "close"}, b"{}"), timeout=20)
    print(f"R12 one {n}-byte header:", first(r), f"{time.time()-t0:.2f}s", rss(), flush=True)
t0 = time.time()
r = raw(b"POST /score HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 50) for i in range(100_000)) + b"Content-Length: 2\r\n\r\n{}", timeout=20)
print("R12 100000 headers:", first(r), f"{time.time()-t0:.2f}s", rss(), flush=True)
# R13 non-JSON / odd bodies with the right token
B = "Bearer s3cret"
for name, body in [("not json", b"hello"), ("invalid utf-8", b'{"rows": [{"data_source": "\xff\xfe"}]}'),
                   ("rows a string", b'{"rows": "x"}'), ("rows of ints", b'{"rows": [1,2]}'), ("empty rows", b'{"rows": []}'),
                   ("NaN", b'{"rows": NaN}'), ("deep nesting 100k", b'[' * 100_000 + b']' * 100_000),
                   ("deep dict nesting 50k in ground_truth", b'{"rows": [{"data_source": "openai/gsm8k", "solution_str": "", "ground_truth": ' + b'{"a":' * 50_000 + b'1' + b'}' * 50_000 + b'}]}'),
                   ("huge int", b'{"rows": [{"data_source": "openai/gsm8k", "solution_str": "", "ground_truth": ' + b'9' * 900_000 + b'}]}'),
                   ("unknown data_source", b'{"rows": [{"data_source": "nope", "solution_str": "", "ground_truth": "1"}]}'),
                   ("score_tokens ragged/negative ids", b'{"prompts": [[-1, 99999999999]], "responses": [[1]]}')]:
    path = "/score_tokens" if name.startswith("score_tokens") else "/score"
    t0 = time.time()
    print(f"R13 {name}:", post(B, body, path=path), f"{time.time()-t0:.2f}s", flush=True)
print("R13 server alive after:", post(B), rss(), flush=True)
# R14 Expect: 100-continue with a wrong token: is 100 Continue sent (inviting the body)?
s = socket.create_connection(("127.0.0.1", PORT), timeout=5)
s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer wrong\r\nExpect: 100-continue\r\nContent-Length: 500000\r\n\r\n")
try: print("R14 Expect 100-continue wrong token:", s.recv(4096).decode(errors="replace").split("\r\n")[0])
except OSError as e: print("R14", type(e).__name__)
s.close()
# R15 websocket upgrade without a token
print("R15 websocket upgrade, no token:", first(raw(req("GET", "/score", {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13"}), timeout=5)))
# R16 pipelining: an authorized request then a wrong-token one on one connection
r = raw(req("POST", "/score", {"Authorization": B, "Content-Length": str(len(GOOD))}, GOOD) + req("POST", "/score", {"Authorization": "Bearer wrong", "Content-Length": "900000"}) + b"x" * 900000, timeout=10)
print("R16 pipelined good + wrong-token 900 kB:", [l for l in r.split("\r\n") if l.startswith("HTTP/")], rss())
# R17 Content-Length spellings
for cl in ["+2", "0x2", " 2", "2 ", "2,2", "٢", "02"]:
    print(f"R17 Content-Length {cl!r}:", first(raw(f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: {B}\r\nContent-Length: {cl}\r\nConnection: close\r\n\r\n{{}}".encode("utf-8"), timeout=6)))
# R18 slowloris with the right token: headers complete, body trickled at 1 byte / 1 s for a 20-byte body (inside the deadline rate?)
t0 = time.time()
s = socket.create_connection(("127.0.0.1", PORT), timeout=20)
s.sendall(f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: {B}\r\nContent-Length: 20\r\n\r\n".encode())
res = "<open>"
try:
    for i in range(20):
        s.sendall(b" "); time.sleep(1)
except OSError as e:
    res = f"dropped at {time.time()-t0:.1f}s ({type(e).__name__})"
try: res += " | " + s.recv(4096).decode(errors='replace').split("\r\n")[0]
except OSError as e: res += f" | {type(e).__name__}"
print("R18 right token, 20-byte body at 1 B/s:", res, flush=True)
# R19 headers trickled with the right token, 1 byte / 0.2 s for 60 s of headers: does it hold the connection forever?
def trickle_headers(out):
    t0 = time.time(); s = socket.create_connection(("127.0.0.1", PORT), timeout=5)
    hdr = f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: {B}\r\nX-Pad: " + "a" * 1000
    try:
        for ch in hdr:
            s.sendall(ch.encode()); time.sleep(0.02)
            if time.time() - t0 > 15: break
        out.append(f"still open after {time.time()-t0:.0f}s")
    except OSError as e:
        out.append(f"dropped at {time.time()-t0:.1f}s")
    s.close()
o = []; trickle_headers(o); print("R19 headers trickled for 15 s:", o[0], flush=True)
# R20 many concurrent connections: 3000 idle sockets, then health and a scoring request
socks = []
err = None
for i in range(3000):
    try:
        socks.append(socket.create_connection(("127.0.0.1", PORT), timeout=5))
    except OSError as e:
        err = f"{type(e).__name__} after {i}"; break
time.sleep(1)
t0 = time.time()
print("R20 3000 idle connections:", err or "all open", "| health:", first(raw(req("GET", "/health", {"Connection": "close"}), timeout=10)), f"{time.time()-t0:.2f}s", "| score:", post(B), rss(), flush=True)
for s in socks: s.close()
# R21 200 concurrent right-token scoring requests
res = []
def one():
    res.append(post(B).split(" ")[1])
ths = [threading.Thread(target=one) for _ in range(200)]
t0 = time.time(); [t.start() for t in ths]; [t.join(60) for t in ths]
from collections import Counter
print("R21 200 concurrent scoring requests:", Counter(res), f"{time.time()-t0:.1f}s", rss(), flush=True)
# R22 concurrent wrong-token big bodies with a different header case, 8 x 40 MB
def big():
    try:
        s = socket.create_connection(("127.0.0.1", PORT), timeout=20)
        s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nauthorization: bearer S3CRET\r\nContent-Length: 40000000\r\n\r\n")
        for _ in range(40): s.sendall(b"x" * 1_000_000)
    except OSError: pass
ths = [threading.Thread(target=big) for _ in range(8)]
[t.start() for t in ths]; [t.join(60) for t in ths]
print("R22 8 x 40 MB wrong-token bodies:", rss(), "| alive:", post(B))
srv.terminate(); srv.wait(10)
print("server log tail:"); print("".join(open("srv2.log").readlines()[-8:]))
