"""`python -m hybridjax.rewards.serve`: reward functions or a reward model over HTTP.

    python -m hybridjax.rewards.serve --port 8000               # built-ins by data_source
    python -m hybridjax.rewards.serve --custom_path my.py --custom_name fn --timeout_s 10
    python -m hybridjax.rewards.serve --model_path ckpt/rm      # *ForSequenceClassification
    python -m hybridjax.rewards.serve --judge_path ckpt/judge \
        --judge_config '{"parser": "number", "max_score": 10}'  # a generative RM (LLM judge)

JSON API (FastAPI + uvicorn; the trainer's client is `hybridjax.rewards.remote`):
  * `GET /health` → `{"status": "ok", "kind": "rule" | "model" | "judge", "serves": str,
    "authorized": true, ...}`: `serves` names the function (or model) behind the URL. Without
    the right bearer token only `{"status": "ok", "authorized": false}`: the server is alive.
  * `POST /score` (rule servers) `{"rows": [{"data_source", "solution_str", "ground_truth",
    "extra_info"}]}` → `{"results": [...]}`, one per row in order: `{"kind": "ok", "score": float,
    "extras": {...}}` or `{"kind": "error" | "crash" | "timeout" | "nonfinite", "error": str}`.
  * `POST /score_tokens` (model servers) `{"prompts": [[int]], "responses": [[int]]}` (token ids
    without padding) → `{"results": [{"kind": "ok", "score": float, "extras": {}}]}`.
  * `POST /judge` (judge servers) `{"rows": [{"prompt": str, "response": str, "ground_truth"}]}`
    → `{"results": [...]}`: the verdict's parsed score with extras `genrm_prompt_tokens`,
    `genrm_verdict_tokens`, or `{"kind": "error"}` for an unparseable verdict
    (`hybridjax.rewards.genrm`: template, parser and sampling from `--judge_config`, the keys of
    `reward_model.generative`; the judge runs on our paged engine with continuous batching, so
    several trainers share one judge).
Before any of a body is read (`hybridjax.rewards.request_guard`): a wrong or missing bearer
token gets 401 (when the environment variable `HYBRIDJAX_REWARD_TOKEN` is set for the server),
a Content-Length over `--max_request_bytes` 413, none 411; a body not in after
`--body_timeout_s` 408. Each drops the connection. A connection whose request headers are not
all in `--header_timeout_s` after it opened (or after its last answer) is closed. A malformed
body gets 422. The server binds 127.0.0.1 unless `--host` says otherwise. Rule functions run
as in the trainer (`hybridjax.rewards.scoring`: custom ones isolated in worker processes with
`--timeout_s`); a
reward model runs on the devices of this process (`CUDA_VISIBLE_DEVICES`, or
`--xla_force_host_platform_device_count` on CPU), its batch sharded over all of them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

import fastapi
import numpy as np
import pydantic

from hybridjax.rewards.manager import RewardConfig, build_scorer
from hybridjax.rewards.remote import TOKEN_ENV
from hybridjax.rewards.request_guard import (
    RequestGuard,
    header_deadline_protocol,
    token_matches,
)
from hybridjax.rewards.scoring import normalize

DEFAULT_MAX_REQUEST_BYTES = 64 << 20
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_HEADER_TIMEOUT_S = 10.0  # uvicorn waits for request headers for ever


class Row(pydantic.BaseModel):
    data_source: str
    solution_str: str
    ground_truth: Any = None
    extra_info: Any = None


class ScoreRequest(pydantic.BaseModel):
    rows: list[Row]


class TokenRequest(pydantic.BaseModel):
    prompts: list[list[pydantic.NonNegativeInt]]
    responses: list[list[pydantic.NonNegativeInt]]


class JudgeRow(pydantic.BaseModel):
    prompt: str
    response: str
    ground_truth: Any = None


class JudgeRequest(pydantic.BaseModel):
    rows: list[JudgeRow]


class ServedModel:
    """A `*ForSequenceClassification` checkpoint on this process's devices, scoring unpadded
    (prompt, response) id lists. Shapes are padded to powers of two (rows also to a multiple of
    the device count), so a server compiles once per bucket; one forward at a time."""

    def __init__(self, path: str, micro_batch_size_per_device: int):
        from flax import nnx

        from hybridjax.models.hf_io import load_pretrained
        from hybridjax.sharding import REWARD_MODEL_RULES, MeshConfig, make_meshes, sharding_fn

        self.mesh = make_meshes(MeshConfig()).train
        model = load_pretrained(
            path, kind="classifier", shardings=sharding_fn(self.mesh, REWARD_MODEL_RULES)
        )
        self.graphdef, self.state = nnx.split(model)
        self.micro = micro_batch_size_per_device
        self.devices = self.mesh.devices.size
        self.path = path
        self._lock = threading.Lock()

    def score(self, prompts: list[list[int]], responses: list[list[int]]) -> list[float]:
        import jax
        from jax.sharding import NamedSharding, PartitionSpec

        from hybridjax.rewards.reward_model import score_responses
        from hybridjax.sharding.mesh import BATCH_AXES

        n, d = len(prompts), self.devices
        if n == 0:
            return []
        bucket = lambda k: 1 << max(0, int(k) - 1).bit_length()
        b = -(-bucket(n) // d) * d  # rows: a power of two, rounded up to a multiple of d
        p = bucket(max(len(x) for x in prompts) or 1)
        r = bucket(max(max(len(x) for x in responses), 1))
        ids_p, mask_p = np.zeros((b, p), np.int32), np.zeros((b, p), np.int32)
        ids_r, mask_r = np.zeros((b, r), np.int32), np.zeros((b, r), np.int32)
        mask_r[n:, 0] = 1  # padding rows read one token, so no row is empty
        for i, (pi, ri) in enumerate(zip(prompts, responses, strict=True)):
            if pi:
                ids_p[i, p - len(pi) :], mask_p[i, p - len(pi) :] = pi, 1
            ids_r[i, : len(ri)], mask_r[i, : len(ri)] = ri, 1
        rows = NamedSharding(self.mesh, PartitionSpec(BATCH_AXES))
        batch = [jax.device_put(x, rows) for x in (ids_p, mask_p, ids_r, mask_r)]
        per_device = b // d
        micro = d * max(k for k in range(1, min(self.micro, per_device) + 1) if per_device % k == 0)
        with self._lock:
            _, scores = score_responses(self.graphdef, self.state, *batch, micro_batch_size=micro)
            scores = np.asarray(jax.device_get(scores))  # host sync
        return [float(s) for s in scores[:n]]


class ServedJudge:
    """A generative reward model (`hybridjax.rewards.genrm.load_judge`) on this process's
    devices (the generation mesh of all of them); one judge batch at a time (the engine's host
    loop is not thread-safe), continuous batching within it."""

    def __init__(self, path: str, block: dict[str, Any], dtype: str = "float32"):
        from hybridjax.rewards import genrm
        from hybridjax.sharding import MeshConfig, make_meshes

        self.config = genrm.JudgeConfig.from_dict(block)
        engine_config = genrm.judge_engine_config(block)
        mesh = make_meshes(MeshConfig()).generate
        self.judge = genrm.load_judge(path, self.config, engine_config, mesh, dtype)
        self.path = path
        self._lock = threading.Lock()

    def score(self, rows: list[JudgeRow]):
        with self._lock:
            return self.judge.score(
                [r.prompt for r in rows], [r.response for r in rows], [r.ground_truth for r in rows]
            )


def describe_rule(config: RewardConfig) -> str:
    """What a rule server scores with, e.g. `built-in rules (naive)` or
    `my.py:fn {"bonus": 0.1} (batch)`; URLs serving different things are refused by clients."""
    fn = "built-in rules"
    if config.custom_path:
        kwargs = json.dumps(dict(config.custom_kwargs), sort_keys=True)
        fn = f"{os.path.basename(config.custom_path)}:{config.custom_name} {kwargs}"
    return f"{fn} ({config.reward_manager})"


def create_app(
    reward_config: RewardConfig | None = None,
    model: ServedModel | None = None,
    token: str = "",
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    judge: ServedJudge | None = None,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> fastapi.FastAPI:
    """The ASGI app: a rule server (`reward_config`), a model server (`model`) or a judge
    server (`judge`).

    Raises:
      ValueError: not exactly one of `reward_config`, `model` and `judge`.
    """
    if sum(x is not None for x in (reward_config, model, judge)) != 1:
        raise ValueError("a reward server serves one of a rule function, a reward model, a judge")

    def authorize(authorization: str = fastapi.Header(default="")) -> None:
        if not token_matches(authorization, token):  # RequestGuard checked it first
            raise fastapi.HTTPException(401, "missing or wrong bearer token")

    scorer = None if reward_config is None else build_scorer(reward_config)[0]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if scorer is not None:
            scorer.close()  # stops the worker processes

    app = fastapi.FastAPI(title="hybridjax reward server", lifespan=lifespan)
    app.add_middleware(
        RequestGuard, token=token, max_bytes=max_request_bytes, body_timeout_s=body_timeout_s
    )
    guarded = [fastapi.Depends(authorize)]

    @app.exception_handler(fastapi.exceptions.RequestValidationError)
    async def invalid(request, exc) -> fastapi.responses.JSONResponse:
        """422 naming each problem's place and rule, without echoing the input (a NaN in it
        cannot be written as JSON: the default answer was a 500 and a traceback)."""
        errors = [{k: e[k] for k in ("type", "loc", "msg") if k in e} for e in exc.errors()]
        return fastapi.responses.JSONResponse({"detail": errors}, status_code=422)

    if model is not None:
        health = {"status": "ok", "kind": "model", "devices": model.devices,
                  "serves": f"model {model.path}"}  # fmt: skip

        @app.post("/score_tokens", dependencies=guarded)
        def score_tokens(request: TokenRequest) -> dict:
            if len(request.prompts) != len(request.responses):
                raise fastapi.HTTPException(422, "prompts and responses differ in length")
            scores = model.score(request.prompts, request.responses)
            return {"results": [normalize(s).to_json() for s in scores]}

    elif judge is not None:
        # the settings' digest: URLs with other templates or sampling are refused together
        settings = json.dumps(dataclasses.asdict(judge.config), sort_keys=True)
        digest = hashlib.sha256(settings.encode()).hexdigest()[:12]
        serves = f"judge {judge.path} ({judge.config.describe()}, {digest})"
        health = {"status": "ok", "kind": "judge", "serves": serves}

        @app.post("/judge", dependencies=guarded)
        def judge_rows(request: JudgeRequest) -> dict:
            return {"results": [o.to_json() for o in judge.score(request.rows)]}

    else:
        assert reward_config is not None and scorer is not None  # one of the three, checked above
        health = {"status": "ok", "kind": "rule", "reward_manager": reward_config.reward_manager,
                  "serves": describe_rule(reward_config)}  # fmt: skip

        @app.post("/score", dependencies=guarded)
        def score(request: ScoreRequest) -> dict:
            rows = [(r.data_source, r.solution_str, r.ground_truth, r.extra_info)
                    for r in request.rows]  # fmt: skip
            return {"results": [o.to_json() for o in scorer.score(rows)]}

    @app.get("/health")
    def health_check(authorization: str = fastapi.Header(default="")) -> dict:
        if not token_matches(authorization, token):
            return {"status": "ok", "authorized": False}  # alive; nothing of what it serves
        return health | {"authorized": True}

    return app


def start_local(
    args: Sequence[str] = (), env: dict[str, str] | None = None, wait_s: float = 120.0
) -> tuple[subprocess.Popen, str]:
    """Starts `python -m hybridjax.rewards.serve *args` on a free port of 127.0.0.1 and waits
    until `/health` answers (for notebooks, tests and benchmarks). Returns (the process, its
    URL); stop it with `process.terminate()`.

    Raises:
      RuntimeError: the server exited or did not answer within `wait_s` (its output attached).
    """
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "hybridjax.rewards.serve", "--port", str(port), *args]
    output = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would block it
    process = subprocess.Popen(cmd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    process.wait()
    output.seek(0)
    raise RuntimeError(f"reward server {' '.join(cmd)} did not start:\n{output.read()}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m hybridjax.rewards.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--custom_path", default="", help="file or module of the reward function")
    parser.add_argument("--custom_name", default="compute_score")
    parser.add_argument("--reward_kwargs", default="{}", help="JSON keyword arguments")
    parser.add_argument("--reward_manager", default="naive", choices=("naive", "batch", "prime"))
    parser.add_argument("--num_workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout_s", type=float, default=30.0)
    parser.add_argument("--model_path", default="", help="an HF *ForSequenceClassification dir")
    parser.add_argument("--micro_batch_size_per_device", type=int, default=16)
    parser.add_argument("--judge_path", default="", help="an HF *ForCausalLM judge dir")
    parser.add_argument(
        "--judge_config", default="{}", help="JSON: keys of reward_model.generative"
    )
    parser.add_argument("--dtype", default="float32", help="the judge's parameters")
    parser.add_argument("--max_request_bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES)
    parser.add_argument(
        "--body_timeout_s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
        help="a request body must arrive within this many seconds of its headers",
    )  # fmt: skip
    parser.add_argument(
        "--header_timeout_s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
        help="a connection must send a request's headers within this many seconds",
    )  # fmt: skip
    args = parser.parse_args(argv)
    token = os.environ.get(TOKEN_ENV, "")
    limits = {"max_request_bytes": args.max_request_bytes, "body_timeout_s": args.body_timeout_s}
    for flag in ("body_timeout_s", "header_timeout_s"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag}={getattr(args, flag)}; must be > 0")
    if args.judge_path:
        try:
            block = json.loads(args.judge_config)
        except json.JSONDecodeError as e:
            parser.error(f"--judge_config is not JSON: {e}")
        served = ServedJudge(args.judge_path, block, args.dtype)
        app = create_app(judge=served, token=token, **limits)
        what = f"judge {args.judge_path} ({served.config.describe()})"
    elif args.model_path:
        app = create_app(
            model=ServedModel(args.model_path, args.micro_batch_size_per_device),
            token=token,
            **limits,
        )
    else:
        try:
            kwargs = json.loads(args.reward_kwargs)
        except json.JSONDecodeError as e:
            parser.error(f"--reward_kwargs is not JSON: {e}")
        config = RewardConfig(
            num_workers=args.num_workers,
            reward_manager=args.reward_manager,
            timeout_s=args.timeout_s,
            custom_path=args.custom_path,
            custom_name=args.custom_name,
            custom_kwargs=tuple(sorted(kwargs.items())),
        )
        app = create_app(config, token=token, **limits)
    import uvicorn

    if not args.judge_path:
        what = f"model {args.model_path}" if args.model_path else describe_rule(config)
    print(f"serving {what} on http://{args.host}:{args.port}", flush=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # one open file per connection
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    protocol = header_deadline_protocol(args.header_timeout_s)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", http=protocol)


if __name__ == "__main__":
    main()
