import os
from hybridjax.tools.sandbox import PythonTool
tool = PythonTool({"timeout_s": 8, "memory_mb": 256, "max_processes": 16, "max_file_mb": 16, "max_open_files": 64})
code = open("/tmp/pr3/keys.py").read().split("# add a")[0]
for iso in ("bwrap",):
    print(tool.execute({"code": code}))
