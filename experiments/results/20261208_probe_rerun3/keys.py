import ctypes, os, struct
libc = ctypes.CDLL(None, use_errno=True)
def kc(op, *a):
    return libc.syscall(250, op, *a)
buf = ctypes.create_string_buffer(4096)
r = kc(11, -3, buf, 4096); ids = struct.unpack(f"{r//4}i", buf.raw[:r]) if r > 0 else ()
print("session ids", ids, os.strerror(ctypes.get_errno()) if r < 0 else "")
for k in ids:
    d = ctypes.create_string_buffer(512); n = kc(6, k, d, 512)
    print("describe", k, d.raw[:max(n,0)], os.strerror(ctypes.get_errno()) if n < 0 else "")
    p = ctypes.create_string_buffer(4096); n = kc(11, k, p, 4096)
    print("read", k, p.raw[:max(n,0)][:80], os.strerror(ctypes.get_errno()) if n < 0 else "")
# add a 'user' key holding a secret to the session keyring, as a trainer might (e.g. a credential helper)
sid = libc.syscall(248, b"user", b"hf_token_probe", b"SECRET-IN-KEYRING", 17, -3)
print("added key", sid, os.strerror(ctypes.get_errno()) if sid < 0 else "")
