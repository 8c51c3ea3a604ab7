"""SGLang-compatible rollout server around rl_tpu's JAX sampler (for TPU rollout hosts).

  python -m launch.serve_rollout --model_path /tmp/rl_tpu_tiny --port 30000

Answers /generate, /update_weights_from_disk, /model_info, /health_generate... as SGLang does
(docs/architecture.md, "SGLang native API"), so the trainer's SGLang client drives it unchanged. Binds 127.0.0.1 unless
--host says otherwise.
"""

import logging

import jax
from absl import app, flags

from rl_tpu import parallel
from rl_tpu.models import hf
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.server import RolloutService, serve

flags.DEFINE_string("model_path", None, "HF model directory to serve.", required=True)
flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 exposes it to the network).")
flags.DEFINE_integer("port", 30000, "Port.")
flags.DEFINE_string("api_key", None, "If set, requests need 'Authorization: Bearer <key>'.")
flags.DEFINE_integer("max_batch", 64, "Rows decoded together.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.DEFINE_string("weight_version", "0", "Version reported for the initial weights.")
flags.DEFINE_bool("skip_tokenizer_init", False, "Serve input_ids only (no tokenizer needed).")


def main(argv):
    del argv
    f = flags.FLAGS
    logging.basicConfig(level=logging.INFO)
    parallel.maybe_initialize_distributed()
    mesh = parallel.make_mesh({"fsdp": -1})
    cfg, params = hf.load(f.model_path, mesh=mesh, dtype=f.dtype)
    tokenizer = None if f.skip_tokenizer_init else load_tokenizer(f.model_path)
    sampler = JaxSampler(cfg, params, tokenizer=tokenizer, max_batch=f.max_batch,
                         mesh=parallel.sampler_mesh(jax.local_devices(), cfg.num_kv_heads),
                         version=f.weight_version)
    server = serve(RolloutService(sampler, f.model_path, tokenizer), f.host, f.port, f.api_key)
    print(f"serving {f.model_path} on http://{f.host}:{f.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    app.run(main)
