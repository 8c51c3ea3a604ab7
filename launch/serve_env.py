"""Serve one registered env over the AgentGym env-server HTTP API.

  python -m launch.serve_env --env babyai --port 36001
  python -m launch.serve_env --env textcraft --port 0 --max_instances 512 \
      --env_kwargs '{"max_depth": 3}'

`--port 0` picks a free port. Once listening, one line goes to stdout:
`rl_tpu env server: <env> at http://<host>:<port>`; scripts that start the server in a
subprocess read the URL from it. Clients: `rl_tpu.envs.remote.RemoteEnv(url, env_name)`, or a
training run given `--config.env.remote_url=<url>` (docs/env_servers.md). An unknown env
name or kwarg fails before the socket is bound, naming the envs or kwargs there are.
An env defined outside rl_tpu is served by importing the module that registers it first:
`--env_module my_envs --env add_digits` (the module must be importable: on PYTHONPATH).
"""

import importlib
import json
import sys

from absl import app, flags

from rl_tpu.envs import base, server

flags.DEFINE_string("env", None, "Registered env name, e.g. babyai or textcraft.", required=True)
flags.DEFINE_string("host", "127.0.0.1", "Bind address; loopback unless you mean to expose it.")
flags.DEFINE_integer("port", 36001, "Port; 0 picks a free one (printed on start).")
flags.DEFINE_integer("max_instances", 256, "Live env instances allowed; /create beyond -> 503.")
flags.DEFINE_string("env_kwargs", "{}", "JSON object of keyword arguments for the env.")
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
        base.check_kwargs(f.env, env_kwargs)  # an unknown env name or kwarg: fail by name
    except ValueError as e:  # one line, not the flag help: the flags were fine
        sys.exit(f"launch.serve_env: {e}")
    try:
        server.serve(f.env, host=f.host, port=f.port, max_instances=f.max_instances,
                     env_kwargs=env_kwargs, ready=ready)
    except ModuleNotFoundError as e:  # the env's package, named with its pip extra
        sys.exit(f"launch.serve_env: {e}")
    except OSError as e:  # most often: the port is taken
        raise app.UsageError(f"cannot serve on {f.host}:{f.port}: {e}; pick another --port "
                             "(0 picks a free one)")
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
