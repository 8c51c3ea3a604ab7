"""SGLang-compatible rollout server around rl_tpu's JAX sampler (for TPU rollout hosts).

  python -m launch.serve_rollout --model_path /tmp/rl_tpu_tiny --port 30000

Answers /generate, /update_weights_from_disk, /model_info, /health_generate... as SGLang does
(docs/rollout_servers.md), so the trainer's SGLang client drives it unchanged. Requests are
batched continuously in a fixed pool of --max_batch rows of --max_context_tokens KV slots
each: its memory is set at start, and a request waits for a free row rather than running the
server out of memory. Binds 127.0.0.1 unless --host says otherwise. A request over a limit
(--max_n, --max_rows, --max_context_tokens, --max_request_tokens) is answered 400 naming it.
The HTTP limits (--max_header_bytes, --header_timeout_s, --max_body_bytes, --body_timeout_s,
--keep_alive_s, --max_connections, --max_json_depth) bound what one client can make the server
hold. A key (`RL_TPU_ROLLOUT_API_KEY=... python -m launch.serve_rollout ...`, which keeps it
out of process lists, or --api_key) makes every request need `Authorization: Bearer <key>`;
the trainer sends RL_TPU_ROLLOUT_API_KEY. --docs serves /docs, /redoc and /openapi.json.
It also speaks OpenAI's API (GET /v1/models, POST /v1/chat/completions and /v1/completions,
streaming included), so an OpenAI client or SGLang's bench_serving drives it unchanged; the
model id it lists is --served_model_name (default: --model_path).
LoRA (--enable_lora): SGLang's /load_lora_adapter, /unload_lora_adapter and a request's
`lora_path`; up to --max_loaded_loras PEFT adapters of rank <= --max_lora_rank on
--lora_target_modules decode side by side with the base (rl_tpu/rollout/adapter_slots.py), and
--lora_paths name=dir,... loads some at start.
JAX's persistent compilation cache is on, as in the training launchers (launch/__init__.py).
Before it listens, the server compiles every program a request can need (--warmup, on by
default: `ContinuousBatcher.warmup`), so no request waits on a compile; the first start
compiles them (50 s for a 3.7M-parameter model on a shared 2-core CPU), a restart loads them
from the cache (12 s there).
"""

import logging
import sys

import jax
from absl import app, flags

from launch import parse_flags, use_compilation_cache
from rl_tpu import parallel, serving
from rl_tpu.heartbeat import Heartbeat
from rl_tpu.http_limits import HttpLimits
from rl_tpu.models import hf, lora
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.rollout.adapter_slots import slot_config
from rl_tpu.rollout.continuous import ContinuousBatcher
from rl_tpu.rollout.sampler import JaxSampler
from rl_tpu.rollout.server import RolloutService, ServerLimits, serve

flags.DEFINE_string("model_path", None, "HF model directory to serve.", required=True)
flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 exposes it to the network).")
flags.DEFINE_integer("port", 30000, "Port.")
flags.DEFINE_string("api_key", None, "If set, requests need 'Authorization: Bearer <key>'; "
                    "default: the environment variable RL_TPU_ROLLOUT_API_KEY (which keeps it "
                    "out of process lists).")
flags.DEFINE_integer("max_batch", 64, "Rows decoded together: the KV pool's rows.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.DEFINE_string("served_model_name", None, "The model id /v1/models lists and OpenAI "
                    "replies carry; default --model_path (as SGLang).")
flags.DEFINE_string("weight_version", "0", "Version reported for the initial weights.")
flags.DEFINE_bool("skip_tokenizer_init", False, "Serve input_ids only (no tokenizer needed).")
flags.DEFINE_integer("kv_tokens", 0, "KV slots the whole pool may hold (rows x "
                     "--max_context_tokens); fewer rows than --max_batch when it says so. "
                     "0 = --max_batch rows.")
flags.DEFINE_integer("decode_chunk", 16, "Most tokens decoded between two looks by the "
                     "scheduler (rows join, aborts and weight updates land, at chunk ends); a "
                     "chunk also ends at the step a row ends, once a quarter of it has run.")
flags.DEFINE_integer("prefix_cache_tokens", 65536, "Tokens of K/V kept for prompts that "
                     "extend an earlier request's prompt + output (multi-turn); 0 = off.")
flags.DEFINE_bool("warmup", True, "Compile every program a request can need before "
                  "listening (the pool's, the prefills', the prefix cache's), so none compiles "
                  "while a request waits; --nowarmup listens at once and compiles on demand.")
flags.DEFINE_float("stall_timeout_s", 300.0, "/health fails once one device call has run "
                   "this long (a wedged sampler).")
flags.DEFINE_float("health_timeout_s", 20.0, "/health_generate fails when its one-token "
                   "generation has not come back in this long.")
serving.add_http_flags(flags, HttpLimits())
_LIMITS = ServerLimits()
flags.DEFINE_integer("max_n", _LIMITS.max_n, "Samples per prompt a request may ask for.")
flags.DEFINE_integer("max_rows", _LIMITS.max_rows, "Prompts x n in one request.")
flags.DEFINE_integer("max_context_tokens", 0, "KV slots of one row: prompt + max_new_tokens "
                     "of a sample; 0 = min(the model's max_position_embeddings, 4096).")
flags.DEFINE_integer("max_request_tokens", _LIMITS.max_request_tokens, "Rows x (prompt + "
                     "max_new_tokens) in one request.")


flags.DEFINE_bool("enable_lora", False, "Serve LoRA adapters (SGLang's --enable-lora).")
flags.DEFINE_integer("max_lora_rank", 16, "The largest adapter rank that can be loaded.")
flags.DEFINE_integer("max_loaded_loras", 4, "Adapters held at once (each a slot every decode "
                     "step computes: K thin matmuls a projection).")
flags.DEFINE_list("lora_target_modules", ["all"], "Projections adapters may target: 'all' or "
                  f"some of {', '.join(lora.TARGETS)}.")
flags.DEFINE_list("lora_paths", [], "Adapters loaded at start: name=PEFT dir, ...")


def lora_setup(f) -> tuple:
    """(targets, [(name, dir)]) of the LoRA flags; UsageError naming the bad one."""
    targets = tuple(lora.TARGETS if f.lora_target_modules == ["all"] else f.lora_target_modules)
    unknown = sorted(set(targets) - set(lora.TARGETS))
    if unknown:
        raise app.UsageError(f"--lora_target_modules: {unknown} are not projections; use 'all' "
                             f"or some of {list(lora.TARGETS)}")
    paths = [item.split("=", 1) for item in f.lora_paths]
    if any(len(p) != 2 or not all(p) for p in paths):
        raise app.UsageError(f"--lora_paths={','.join(f.lora_paths)}: give name=dir pairs")
    if paths and not f.enable_lora:
        raise app.UsageError("--lora_paths needs --enable_lora")
    return targets, paths


def pool_shape(max_batch: int, kv_tokens: int, context: int, positions: int
               ) -> tuple[int, int]:
    """(rows, slots a row) of the KV pool: slots a multiple of 16 (the prompt bucket and the
    prefix cache's page), at most the model's positions."""
    slots = min(context or 4096, positions) // 16 * 16
    if slots < 16:
        raise app.UsageError(f"--max_context_tokens={context}: a row needs at least 16 slots")
    rows = max_batch if not kv_tokens else min(max_batch, kv_tokens // slots)
    if rows < 1:
        raise app.UsageError(f"--kv_tokens={kv_tokens} holds no row of {slots} slots; raise it "
                             "or lower --max_context_tokens")
    return rows, slots


def main(argv):
    del argv
    f = flags.FLAGS
    logging.basicConfig(level=logging.INFO)
    try:
        http_limits = serving.http_limits_from_flags(f)
    except ValueError as e:
        sys.exit(f"launch.serve_rollout: {e}")  # one line, not the flag help
    use_compilation_cache()  # a restarted server loads its programs instead of compiling them
    parallel.maybe_initialize_distributed()
    mesh = parallel.make_mesh({"fsdp": -1})
    cfg, params = hf.load(f.model_path, mesh=mesh, dtype=f.dtype)
    targets, adapter_paths = lora_setup(f)
    if f.enable_lora:
        cfg = slot_config(cfg, f.max_lora_rank, f.max_loaded_loras, targets)
    rows, slots = pool_shape(f.max_batch, f.kv_tokens, f.max_context_tokens,
                             cfg.max_position_embeddings)
    tokenizer = None if f.skip_tokenizer_init else load_tokenizer(f.model_path)
    sampler = JaxSampler(cfg, params, tokenizer=tokenizer, max_batch=rows,
                         mesh=parallel.sampler_mesh(jax.local_devices(), cfg.num_kv_heads),
                         version=f.weight_version, prefix_cache_tokens=f.prefix_cache_tokens)
    for name, path in adapter_paths:
        sampler.load_adapter(name, path)
    batcher = ContinuousBatcher(sampler, slots=rows, slot_tokens=slots,
                                decode_chunk=f.decode_chunk)
    if f.warmup:
        # a line every few seconds through it: the first start compiles for up to a minute
        with Heartbeat("warm-up: compiling every program a request can need"):
            warm = batcher.warmup()
        print(f"warm-up: {warm['programs']} programs compiled or loaded in "
              f"{warm['seconds']:.1f} s", flush=True)
    limits = ServerLimits(max_n=f.max_n, max_rows=f.max_rows, max_context_tokens=slots,
                          max_request_tokens=f.max_request_tokens)
    service = RolloutService(sampler, f.model_path, tokenizer, limits, batcher=batcher,
                             stall_timeout_s=f.stall_timeout_s,
                             served_model_name=f.served_model_name)
    server = serve(service, f.host, f.port,
                   serving.api_key_from(f.api_key, "RL_TPU_ROLLOUT_API_KEY"),
                   health_timeout_s=f.health_timeout_s, limits=http_limits, docs=f.docs)
    print(f"serving {f.model_path} on {server.url} ({rows} rows x {slots} KV slots)",
          flush=True)
    server.serve_forever()


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)  # --help exits 0
