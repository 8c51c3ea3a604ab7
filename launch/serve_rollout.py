"""SGLang-compatible rollout server around rl_tpu's JAX sampler (for TPU rollout hosts).

  python -m launch.serve_rollout --model_path /tmp/rl_tpu_tiny --port 30000

Answers /generate, /update_weights_from_disk, /model_info, /health_generate... as SGLang does
(docs/architecture.md, "SGLang native API"), so the trainer's SGLang client drives it
unchanged. Binds 127.0.0.1 unless --host says otherwise. A request over a limit (--max_n,
--max_rows, --max_context_tokens, --max_request_tokens) is answered 400 naming it.
"""

import logging

import jax
from absl import app, flags

from rl_tpu import parallel
from rl_tpu.models import hf
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.server import RolloutService, ServerLimits, serve

flags.DEFINE_string("model_path", None, "HF model directory to serve.", required=True)
flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 exposes it to the network).")
flags.DEFINE_integer("port", 30000, "Port.")
flags.DEFINE_string("api_key", None, "If set, requests need 'Authorization: Bearer <key>'.")
flags.DEFINE_integer("max_batch", 64, "Rows decoded together.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.DEFINE_string("weight_version", "0", "Version reported for the initial weights.")
flags.DEFINE_bool("skip_tokenizer_init", False, "Serve input_ids only (no tokenizer needed).")
flags.DEFINE_integer("kv_tokens", 0, "KV-cache tokens a decode batch may hold (rows x (prompt + "
                     "new)); 0 = --max_batch rows whatever their length.")
_LIMITS = ServerLimits()
flags.DEFINE_integer("max_n", _LIMITS.max_n, "Samples per prompt a request may ask for.")
flags.DEFINE_integer("max_rows", _LIMITS.max_rows, "Prompts x n in one request.")
flags.DEFINE_integer("max_context_tokens", _LIMITS.max_context_tokens, "Prompt + max_new_tokens "
                     "of a row; 0 = the model's max_position_embeddings (never more).")
flags.DEFINE_integer("max_request_tokens", _LIMITS.max_request_tokens, "Rows x (prompt + "
                     "max_new_tokens) in one request.")


def main(argv):
    del argv
    f = flags.FLAGS
    logging.basicConfig(level=logging.INFO)
    parallel.maybe_initialize_distributed()
    mesh = parallel.make_mesh({"fsdp": -1})
    cfg, params = hf.load(f.model_path, mesh=mesh, dtype=f.dtype)
    tokenizer = None if f.skip_tokenizer_init else load_tokenizer(f.model_path)
    sampler = JaxSampler(cfg, params, tokenizer=tokenizer, max_batch=f.max_batch,
                         kv_tokens=f.kv_tokens,
                         mesh=parallel.sampler_mesh(jax.local_devices(), cfg.num_kv_heads),
                         version=f.weight_version)
    limits = ServerLimits(max_n=f.max_n, max_rows=f.max_rows,
                          max_context_tokens=f.max_context_tokens,
                          max_request_tokens=f.max_request_tokens)
    server = serve(RolloutService(sampler, f.model_path, tokenizer, limits), f.host, f.port,
                   f.api_key)
    print(f"serving {f.model_path} on http://{f.host}:{f.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    app.run(main)
