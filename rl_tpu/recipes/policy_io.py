"""The policy into and out of a run: the HF directory it starts from (or a tiny random model
written once), loading it with fresh or saved LoRA adapters (`model.lora.*` as a LoraConfig:
`lora_config`, the one reader of `model.lora.rank`), merging adapters into a plain model,
and the final exports (an HF directory, a PEFT adapter).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Optional

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from rl_tpu import parallel
from rl_tpu.models import hf, lora, peft_format, tiny
from rl_tpu.models.tokenizer import ChatTokenizer, load_tokenizer
from rl_tpu.models.transformer import ModelConfig, Transformer
from rl_tpu.persistence.checkpoint_errors import RunWriteError
from rl_tpu.recipes.env_factory import env_text


def model_path(config: ml_collections.ConfigDict, workdir: str) -> str:
    """The HF dir of the initial policy: `model.path`, or a tiny random model written once
    into <workdir>/init_model (same seed, same model: a rerun finds it there)."""
    if config.model.path:
        if not os.path.isfile(os.path.join(config.model.path, "config.json")):
            raise FileNotFoundError(f"model.path={config.model.path!r} has no config.json; "
                                    "point it at a Hugging Face model directory")
        return config.model.path
    out = os.path.join(workdir, "init_model")
    if jax.process_index() == 0 and not os.path.isfile(os.path.join(out, "config.json")):
        m = config.model
        tiny.write_tiny_model(out, arch=m.tiny_arch, vocab_size=m.tiny_vocab, seed=config.seed,
                              corpus=env_text(config, m.tiny_corpus_tasks),
                              init_scale=m.tiny_init_scale, **tiny_shape(config))
    parallel.sync_hosts("tiny_model")
    return out


def tiny_shape(config: ml_collections.ConfigDict) -> dict:
    """The ModelConfig fields of the tiny random model `model.tiny_*` describe."""
    m = config.model
    heads = max(1, m.tiny_hidden // 16)
    return dict(hidden_size=m.tiny_hidden, intermediate_size=2 * m.tiny_hidden,
                num_layers=m.tiny_layers, num_heads=heads, num_kv_heads=max(1, heads // 2),
                head_dim=16)


def lora_config(config: ml_collections.ConfigDict) -> Optional[lora.LoraConfig]:
    """The adapters `model.lora.*` describe, with the embedded sampler's mode
    (`model.lora.sampler`), or None for full fine-tuning (rank 0): the one place a run config's
    LoRA block is read; after it, `lora.is_on(model_cfg)` says whether LoRA is on. Raises
    ValueError naming `model.lora` for a field LoraConfig refuses."""
    b = config.model.lora
    if b.rank <= 0:
        return None
    targets = (lora.TARGETS if b.targets.strip() == "all"
               else tuple(t.strip() for t in b.targets.split(",") if t.strip()))
    try:
        return lora.LoraConfig(rank=b.rank, alpha=b.alpha, dropout=b.dropout, targets=targets,
                               init=b.init, rslora=b.rslora, sampler=b.sampler)
    except ValueError as e:
        raise ValueError(f"model.lora: {e}") from None


def check_adapter_matches(loaded: lora.LoraConfig, configured: lora.LoraConfig,
                          path: str) -> None:
    """The adapter of model.lora.path must be the one model.lora.* describes (rank, alpha,
    targets, rslora), so a config read later (a resume, a sweep) means what ran."""
    fields = ("rank", "alpha", "targets", "rslora")
    diff = {f: (getattr(loaded, f), getattr(configured, f)) for f in fields
            if (sorted(getattr(loaded, f)) if f == "targets" else getattr(loaded, f))
            != (sorted(getattr(configured, f)) if f == "targets" else getattr(configured, f))}
    if diff:
        said = ", ".join(f"model.lora.{f}={theirs!r} (the adapter: {ours!r})"
                         for f, (ours, theirs) in diff.items())
        raise ValueError(f"model.lora.path={path} holds another adapter than the config "
                         f"describes: {said}; set those keys to the adapter's values")


def load_policy(config: ml_collections.ConfigDict, path: str, mesh: Mesh
                ) -> tuple[ModelConfig, Transformer, dict, ChatTokenizer]:
    """(model config, model, params in their shardings, chat tokenizer) from an HF dir."""
    m = config.model
    cfg, params = hf.load(path, mesh=mesh, dtype=m.dtype, remat=m.remat,
                          scan_layers=m.scan_layers, attention_block=m.attention_block,
                          attention_impl=m.attention_impl)
    adapter = lora_config(config)
    if adapter is not None and m.lora.path:  # a PEFT adapter to start from
        cfg, params = peft_format.load_adapter(m.lora.path, cfg, params, mesh=mesh)
        check_adapter_matches(cfg.lora, adapter, m.lora.path)
        # what PEFT's file does not hold: the training dropout and the sampler's mode
        cfg = cfg.replace(lora=dataclasses.replace(cfg.lora, dropout=adapter.dropout,
                                                   sampler=adapter.sampler))
    elif adapter is not None:  # fresh adapters on the loaded (frozen) base
        cfg = cfg.replace(lora=adapter)
        params = with_fresh_adapters(Transformer(cfg, mesh=mesh), params, mesh, config.seed)
    return cfg, Transformer(cfg, mesh=mesh), params, load_tokenizer(path)


def with_fresh_adapters(model, params, mesh: Mesh, seed: int) -> dict:
    """`params` (a base without adapters) plus fresh adapters of `model` (a Transformer or a
    model over one, whose cfg has `lora`), each in its sharding on `mesh`. B starts at zero
    under PEFT's inits, so the result computes exactly what the base does."""
    abstract, names = parallel.logical_axes_of(model, np.zeros((1, 1), np.int32))
    shardings = parallel.param_shardings(abstract, names, mesh)
    return lora.with_adapters(params, lora.init_adapters(model, (abstract, shardings), seed))


@functools.lru_cache(maxsize=8)
def _merge_fn(cfg: lora.LoraConfig):
    return jax.jit(lambda p: lora.merge(p, cfg))  # one compile a LoRA config, not a call


def merged(model_cfg: ModelConfig, params) -> tuple[ModelConfig, dict]:
    """(config, params) of the plain model computing what a LoRA policy computes: every
    adapter merged into its kernel, on device in the kernels' shardings. A model without
    adapters is returned as it is."""
    if not lora.is_on(model_cfg):
        return model_cfg, params
    return model_cfg.replace(lora=None), _merge_fn(model_cfg.lora)(params)


def export_hf(path: str, model_cfg: ModelConfig, params, tokenizer: ChatTokenizer) -> None:
    """The final policy as an HF directory at `path`; a disk that refuses it (full, read-only,
    no permission) is one RunWriteError naming the path, as a refused checkpoint is. The run
    is not marked finished before its export, so a rerun exports again from the checkpoint."""
    model_cfg, params = merged(model_cfg, params)  # a plain HF model: adapters merged in
    try:
        hf.save(path, model_cfg, params, tokenizer=tokenizer.hf)
    except RunWriteError:
        raise
    except OSError as err:
        raise RunWriteError("the final HF export", path, err,
                            "the checkpoints are intact: rerun the same command to export "
                            "again") from err


def export_adapter(path: str, model_cfg: ModelConfig, params, base_path: str) -> None:
    """A LoRA policy's adapters as a PEFT adapter dir at `path` (peft_format.py: loads with
    `PeftModel.from_pretrained(<the base at base_path>, path)`, or SGLang's --lora-paths);
    a refused write is one RunWriteError, as for export_hf."""
    try:
        peft_format.save_adapter(path, model_cfg, params, base_model_path=base_path)
    except OSError as err:
        raise RunWriteError("the final adapter export", path, err,
                            "the checkpoints are intact: rerun the same command to export "
                            "again") from err
