"""Serve one registered env over the AgentGym env-server HTTP API.

  python -m launch.serve_env --env babyai --port 36001
  python -m launch.serve_env --env textcraft --port 0 --max_instances 512 \
      --env_kwargs '{"max_depth": 3}'

`--port 0` picks a free port. Once listening, one line goes to stdout:
`rl_tpu env server: <env> at http://<host>:<port>`; scripts that start the server in a
subprocess read the URL from it. `--error_style agentgym` answers errors as AgentGym's servers
do (HTTP 200 `{"error": "..."}`) instead of rl_tpu's 4xx/5xx `{"error": {"message": "..."}}`;
`--idle_timeout_s` closes instances no request has touched for that long (0: never).
Clients: `rl_tpu.env_serving.remote.RemoteEnv(url, env_name)`, or a training run given
`--config.env.remote_url=<url>` (docs/env_servers.md). An unknown env
name or kwarg fails before the socket is bound, naming the envs or kwargs there are.
An env defined outside rl_tpu is served by importing the module that registers it first:
`--env_module my_envs --env add_digits` (the module must be importable: on PYTHONPATH).

An env server runs whatever actions it is sent: give it a key before exposing it
(`RL_TPU_ENV_API_KEY=... python -m launch.serve_env ...`, which keeps the key out of process
lists, or `--api_key`); every request then needs `Authorization: Bearer <key>`, and RemoteEnv
sends it from RL_TPU_ENV_API_KEY. The HTTP limits (--max_header_bytes, --header_timeout_s,
--max_body_bytes, --body_timeout_s, --keep_alive_s, --max_connections, --max_json_depth) bound
what one client can make the server hold; --docs serves /docs, /redoc and /openapi.json.
"""

import importlib
import json
import sys

from absl import app, flags

from launch import parse_flags
from rl_tpu import serving
from rl_tpu.env_serving import server
from rl_tpu.core import env as env_lib
from rl_tpu.envs import ENV_MODULES

flags.DEFINE_string("env", None, "Registered env name, one of: " + ", ".join(sorted(ENV_MODULES))
                    + " (or one that an --env_module registers).", required=True)
flags.DEFINE_string("host", "127.0.0.1", "Bind address; loopback unless you mean to expose it.")
flags.DEFINE_integer("port", 36001, "Port; 0 picks a free one (printed on start).")
flags.DEFINE_integer("max_instances", 256, "Live env instances allowed; /create beyond -> 503.")
flags.DEFINE_float("idle_timeout_s", 600.0, "Close an env instance after this many seconds "
                   "without a request (its id then answers 404, expired); 0 = never.")
flags.DEFINE_enum("error_style", "rl_tpu", server.ERROR_STYLES, "rl_tpu: errors are HTTP "
                  "4xx/5xx {\"error\": {\"message\"}}; agentgym: HTTP 200 {\"error\": msg}, as "
                  "AgentGym's own servers answer.")
flags.DEFINE_integer("threads", 0, "Threads that run env calls, so requests on different "
                     "instances run in parallel; 0 = one per instance (--max_instances).")
flags.DEFINE_string("env_kwargs", "{}", "JSON object of keyword arguments for the env.")
flags.DEFINE_string("api_key", None, "If set, requests need 'Authorization: Bearer <key>'; "
                    f"default: the environment variable {server.API_KEY_ENV} (which keeps it "
                    "out of process lists).")
serving.add_http_flags(flags, server.ENV_LIMITS)
flags.DEFINE_multi_string("env_module", [], "Python module to import first, e.g. my_envs: one "
                          "that registers envs defined outside rl_tpu (repeatable).")


def main(argv):
    del argv
    f = flags.FLAGS
    try:
        env_kwargs = json.loads(f.env_kwargs)
    except json.JSONDecodeError as e:
        raise app.UsageError(f"--env_kwargs is not valid JSON ({e}): {f.env_kwargs!r}")
    if not isinstance(env_kwargs, dict):
        raise app.UsageError(f"--env_kwargs must be a JSON object, got {f.env_kwargs!r}")

    for module in f.env_module:
        try:
            importlib.import_module(module)
        except ImportError as e:
            sys.exit(f"launch.serve_env: --env_module {module}: {e}; is its directory on "
                     "PYTHONPATH?")

    def ready(url: str) -> None:
        print(f"rl_tpu env server: {f.env} at {url}", flush=True)

    try:
        env_lib.check_kwargs(f.env, env_kwargs)  # an unknown env name or kwarg: fail by name
    except ValueError as e:  # one line, not the flag help: the flags were fine
        sys.exit(f"launch.serve_env: {e}")
    if f.idle_timeout_s < 0 or f.threads < 0 or f.max_instances < 1:
        raise app.UsageError("--idle_timeout_s and --threads must be >= 0, --max_instances "
                             ">= 1")
    try:
        limits = serving.http_limits_from_flags(f)
    except ValueError as e:
        sys.exit(f"launch.serve_env: {e}")  # one line, not the flag help
    try:
        server.serve(f.env, host=f.host, port=f.port, max_instances=f.max_instances,
                     env_kwargs=env_kwargs, ready=ready, error_style=f.error_style,
                     idle_timeout_s=f.idle_timeout_s or None, threads=f.threads or None,
                     limits=limits, api_key=serving.api_key_from(f.api_key, server.API_KEY_ENV),
                     docs=f.docs)
    except ModuleNotFoundError as e:  # the env's package, named with its pip extra
        sys.exit(f"launch.serve_env: {e}")
    except (TypeError, ValueError) as e:  # a kwarg value the env refuses, at construction
        sys.exit(f"launch.serve_env: env {f.env!r} with --env_kwargs {f.env_kwargs} could not "
                 f"be built: {type(e).__name__}: {e}")
    except OSError as e:  # most often: the port is taken
        raise app.UsageError(f"cannot serve on {f.host}:{f.port}: {e}; pick another --port "
                             "(0 picks a free one)")
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)  # --help exits 0
