"""Reward-model server: an HF *ForSequenceClassification dir over SGLang's /v1/classify and /score.

  python -m launch.serve_reward --model_path /tmp/rm_largest/reward_model_hf --port 30100

Answers POST /v1/classify (SGLang's and vLLM 0.7's classification API: text in, each label's
probability and the raw scores out), POST /score (token ids in, [N, C] raw scores out: what an
RL run with `--config.reward.urls=http://HOST:30100` sends), GET /health, /get_model_info and
/load (rl_tpu/rewards/server.py, docs/rewards.md). Requests that arrive together are scored
together: one scoring thread drains the queue into one batch. The model runs data-parallel on
--devices of this host's devices (0 = all), in --tokens_per_batch tokens a device call.
Binds 127.0.0.1 unless --host says otherwise. A request over a limit (--max_sequences,
--max_sequence_tokens, --max_request_tokens) is answered 400 naming it; the HTTP limits
(--max_header_bytes, --header_timeout_s, --max_body_bytes, --body_timeout_s, --keep_alive_s,
--max_connections, --max_json_depth) bound what one client can make the server hold. A key
(`RL_TPU_REWARD_API_KEY=... python -m launch.serve_reward ...`, which keeps it out of process
lists, or --api_key) makes every request need `Authorization: Bearer <key>`; the RL run's
client sends RL_TPU_REWARD_API_KEY. Before it listens the server compiles the program of every
length bucket a request can reach (--warmup, on by default).
"""

import logging
import sys

import jax
from absl import app, flags

from launch import parse_flags, use_compilation_cache
from rl_tpu import serving
from rl_tpu.heartbeat import Heartbeat
from rl_tpu.http_limits import HttpLimits
from rl_tpu.models import hf
from rl_tpu.models.tokenizer import load_tokenizer
from rl_tpu.rewards.scorer import RewardScorer
from rl_tpu.rewards.server import API_KEY_ENV, RewardLimits, RewardService, serve

flags.DEFINE_string("model_path", None, "HF *ForSequenceClassification directory to serve.",
                    required=True)
flags.DEFINE_string("host", "127.0.0.1", "Interface to bind (0.0.0.0 exposes it to the network).")
flags.DEFINE_integer("port", 30100, "Port; 0 picks a free one (printed on start).")
flags.DEFINE_integer("devices", 0, "This host's devices the model runs on, data-parallel "
                     "(the first N); 0 = all of them.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Params and compute dtype.")
flags.DEFINE_integer("tokens_per_batch", 16384, "Rows x padded length of one device call.")
flags.DEFINE_string("served_model_name", "", "The `model` replies carry; default the path.")
flags.DEFINE_bool("skip_tokenizer_init", False, "Serve token ids only (no tokenizer needed).")
flags.DEFINE_bool("warmup", True, "Compile every length bucket's program before listening.")
flags.DEFINE_string("api_key", None, "If set, requests need 'Authorization: Bearer <key>'; "
                    f"default: the environment variable {API_KEY_ENV} (which keeps it out of "
                    "process lists).")
serving.add_http_flags(flags, HttpLimits())
_LIMITS = RewardLimits()
flags.DEFINE_integer("max_sequences", _LIMITS.max_sequences, "Sequences one request may hold.")
flags.DEFINE_integer("max_sequence_tokens", 0, "Tokens of one sequence; 0 = the model's "
                     "max_position_embeddings.")
flags.DEFINE_integer("max_request_tokens", _LIMITS.max_request_tokens, "Tokens of all one "
                     "request's sequences together.")
flags.DEFINE_integer("max_queued_requests", _LIMITS.max_queued_requests, "Requests held at "
                     "once (queued or being scored); one more is answered 503 + Retry-After.")


def main(argv):
    del argv
    f = flags.FLAGS
    logging.basicConfig(level=logging.INFO)
    try:
        http_limits = serving.http_limits_from_flags(f)
        limits = RewardLimits(f.max_sequences, f.max_sequence_tokens, f.max_request_tokens,
                              f.max_queued_requests)
    except ValueError as e:
        sys.exit(f"launch.serve_reward: {e}")  # one line, not the flag help
    local = jax.local_devices()
    if not 0 <= f.devices <= len(local):
        raise app.UsageError(f"--devices={f.devices}: this host has {len(local)}; give 1.."
                             f"{len(local)} or 0 for all")
    use_compilation_cache()  # a restarted server loads its programs instead of compiling them
    try:
        scorer = RewardScorer.from_dir(f.model_path, local[:f.devices or len(local)],
                                       dtype=f.dtype, tokens_per_batch=f.tokens_per_batch)
        tokenizer = None if f.skip_tokenizer_init else load_tokenizer(f.model_path)
    except (hf.CheckpointError, FileNotFoundError, ValueError) as e:
        sys.exit(f"launch.serve_reward: --model_path={f.model_path}: {e}")
    service = RewardService(scorer, f.model_path, tokenizer, limits,
                            served_name=f.served_model_name or None)
    if f.warmup:
        # a line every few seconds through it: the first start compiles for up to a minute
        with Heartbeat("warm-up: compiling every program a request can need"):
            warm = service.warmup()
        print(f"warm-up: {warm['programs']} programs compiled or loaded in "
              f"{warm['seconds']:.1f} s", flush=True)
    try:
        server = serve(service, f.host, f.port, serving.api_key_from(f.api_key, API_KEY_ENV),
                       limits=http_limits, docs=f.docs)
    except OSError as e:  # most often: the port is taken
        service.close()
        raise app.UsageError(f"cannot serve on {f.host}:{f.port}: {e}")
    # listening from here (serve_forever accepts what waits in the backlog): a script that
    # reads the url below may connect at once
    server.socket.listen(2048)
    print(f"rl_tpu reward server: {f.model_path} ({service.num_labels} label(s), "
          f"{scorer.devices} device(s)) at {server.url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)  # --help exits 0
