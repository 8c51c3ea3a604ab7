"""Serving environments and calling them: the machinery around the envs of `rl_tpu.envs`.

  server.py       any registered env behind AgentGym's env-server HTTP API (FastAPI);
                  env_service.py its logic, server_wire.py its request models and error
                  replies
  remote.py       the client of that API (AgentGym's own servers and rl_tpu's);
                  remote_http.py its httpx transport
  workers.py      a thread pool with per-call time limits for blocking env calls (the agent
                  loop steps envs through it)
  isolated.py     scorers run in worker processes of their own (math, reasoning-gym)
"""
