"""Writes a small random-weight model in HF format (config, safetensors, ChatML tokenizer).

  python -m launch.make_tiny_model --arch qwen2 --out /tmp/tiny_qwen2
"""

import sys

from absl import app, flags

from rl_tpu.models import tiny

flags.DEFINE_enum("arch", "qwen2", sorted(tiny.FAMILY_SWITCHES), "Model family.")
flags.DEFINE_string("out", None, "Output directory (new or empty, unless --overwrite).",
                    required=True)
flags.DEFINE_bool("overwrite", False, "Replace --out if it exists and is not empty.")
flags.DEFINE_integer("vocab_size", 512, "Vocabulary size (tokenizer and embedding rows).")
flags.DEFINE_integer("num_layers", 2, "Decoder layers.")
flags.DEFINE_integer("seed", 0, "Seed of the random weights.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Dtype of the saved weights.")


def main(argv):
    del argv
    f = flags.FLAGS
    try:
        cfg = tiny.write_tiny_model(f.out, f.arch, f.vocab_size, f.seed, f.dtype,
                                    overwrite=f.overwrite, num_layers=f.num_layers)
    except FileExistsError:
        sys.exit(f"error: --out={f.out} exists and is not empty; pass --overwrite to replace it, "
                 "or pick another --out")
    print(f"wrote {f.out}: {tiny.describe(cfg)}")


if __name__ == "__main__":
    app.run(main)
