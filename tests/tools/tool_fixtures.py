"""Tools for the executor's tests, in a module of their own: worker processes import it to
unpickle them, so it imports nothing heavy."""

import time

from hybridjax.tools import Tool


class Slow(Tool):
    default_schema = {"type": "function", "function": {"name": "slow"}}

    def execute(self, arguments):
        time.sleep(arguments["s"])
        return "done"


class Long(Tool):
    default_schema = {"type": "function", "function": {"name": "long"}}

    def execute(self, arguments):
        return "x" * 500


class Failing(Tool):
    default_schema = {"type": "function", "function": {"name": "fail"}}

    def execute(self, arguments):
        raise KeyError("boom")


class BigPower(Tool):
    """Big-integer work in one C call: the GIL is held until it returns (minutes)."""

    default_schema = {"type": "function", "function": {"name": "big_power"}}

    def execute(self, arguments):
        return str(len(str(7 ** (10**9))))


class Daemon(Tool):
    """Starts a daemon (fork, new session, fork again) that sleeps; returns its pid."""

    default_schema = {"type": "function", "function": {"name": "daemon"}}

    def execute(self, arguments):
        import os

        reader, writer = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(writer, str(os.getpid()).encode())
                time.sleep(600)
            os._exit(0)
        os.wait()
        return os.read(reader, 32).decode()
