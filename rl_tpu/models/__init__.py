"""The policy, value and reward models in pure JAX/Flax, and the HF files they load from.

The public names (each imported from its module on first use: `import rl_tpu.models` loads no
JAX; rl_tpu/lazy_api.py):

    Transformer, ModelConfig      the decoder (Llama, Qwen2, Qwen3 families) and its config;
    RopeScaling, ARCHITECTURES    its RoPE scaling and the families it implements
    init_cache                    an empty KV cache for the sampler's decode
    token_logprobs                the log-probability of each target token (chunked over the
                                  vocabulary, never the full logits)
    ChatTokenizer, load_tokenizer a model directory's tokenizer with its chat template
    LoraConfig                    LoRA adapters: rank, alpha, targets, the sampler's mode
    ValueModel                    the critic (PPO, GAE): the decoder with a scalar head
    RewardModel, sequence_scores  a reward model (a sequence-classification head) and the
                                  scores it gives sequences
    CheckpointError               an HF model directory that cannot be loaded, naming why
    PRESETS, preset_config        named model sizes (qwen2.5-7b, ...) for compile checks
    tiny_config, write_tiny_model a tiny random model (tests, smoke runs)

Loading and saving HF directories is `rl_tpu.models.hf` (`hf.load`, `hf.save`); the rest of
the modules (attention kernels, GGUF import, PEFT export) are imported by name.
"""

from rl_tpu.lazy_api import lazy_api, public_names

_HOMES = {
    ".transformer": ("Transformer", "ModelConfig", "RopeScaling", "ARCHITECTURES",
                     "init_cache"),
    ".logprobs": ("token_logprobs",),
    ".tokenizer": ("ChatTokenizer", "load_tokenizer"),
    ".lora": ("LoraConfig",),
    ".value": ("ValueModel",),
    ".reward_model": ("RewardModel", "sequence_scores"),
    ".hf": ("CheckpointError",),
    ".presets": ("PRESETS", "preset_config"),
    ".tiny": ("tiny_config", "write_tiny_model"),
}
__all__ = public_names(_HOMES)
__getattr__, __dir__ = lazy_api(__name__, _HOMES)
