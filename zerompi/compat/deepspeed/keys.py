"""The DeepSpeed 0.19.8 keys zerompi knows, as tables: which are read, their old spellings, which
change nothing here, which values zerompi's arithmetic fixes, and the features it refuses and why.

screen.py applies the spellings and refusals, config.py and swap.py map what remains.
"""
from __future__ import annotations

from typing import Any

from zerompi.compat.deepspeed.schedule import ALL_PARAMS

OFFLOAD_PARAM = ("device", "nvme_path", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu")
OFFLOAD_OPTIMIZER = ("device", "nvme_path", "pin_memory", "buffer_count", "pipeline_read", "pipeline_write",
                     "fast_init", "ratio", "super_offload", "cpuadam_cores_perc")
AIO = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit", "overlap_events", "use_gds",
       "thread_count")
ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction")
SGD_PARAMS = ("lr", "momentum", "weight_decay")
MUON_PARAMS = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "ns_method", "betas", "eps",
               "adam_w_mode", "torch_adam", "per_head_muon")
"""optimizer.params read for type Muon (muon.py; torch_adam picks DeepSpeed's Adam kernel, same arithmetic)."""
ACTIVATION_CHECKPOINTING = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
                            "number_checkpoints", "synchronize_checkpoint_boundary", "profile")
DATA_TYPES = ("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules")
COMPILE = ("deepcompile", "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
           "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log",
           "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
           "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors", "passes")
"""DeepSpeed 0.19.8's ``compile`` block: DeepCompile's switch and the options of its passes, read only when
``deepcompile`` is true (``engine.compile()`` is what compiles; the block alone compiles nothing)."""
DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
          "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
          "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}
"""The dtype names DeepSpeed 0.19.8 reads in ``communication_data_type`` and ``data_types`` (lower case)."""
COMPUTE_DTYPE_KEYS: dict[str, str] = {
    "communication_data_type": "zerompi reduces the gradients in the compute dtype (bf16 and fp16 gradients go on "
                               "the wire as they are and are summed in fp32, then stored in the compute dtype)",
    "data_types.grad_accum_dtype": "zerompi accumulates gradients over micro-batches in the compute dtype",
    "data_types.param_dtype": "the parameters are computed in the dtype bf16/fp16 enable (DeepSpeed asserts the "
                              "same)",
}
"""Dtype keys whose only allowed value is the compute dtype (bf16 or fp16 when enabled, else fp32): that is
DeepSpeed's default for each and what zerompi computes; another dtype is other arithmetic."""
BUFFER_DTYPE = ("data_types.buffer_dtype", "zerompi either leaves each buffer in the dtype the model gives it "
                "(null, DeepSpeed's default) or casts the floating ones to the compute dtype")
"""data_types.buffer_dtype: null keeps the model's buffer dtypes (zerompi's buffer_dtype='model'), the compute dtype
casts them to it ('compute'); another dtype is refused."""
KEEP_IN_FP32 = ("data_types.keep_in_fp32_modules", (None, "auto", []),
                "zerompi keeps buffers in the dtype the model gives them, or the compute dtype (DeepSpeed's default "
                "\"auto\" also upcasts the buffers of a transformers model's _keep_in_fp32_modules_strict that "
                "arrive below fp32; zerompi does not), and has no list of modules whose buffers it upcasts")
"""data_types.keep_in_fp32_modules: DeepSpeed's default ("auto", also written out by templates), [] and null are
accepted, a list of module patterns is refused."""
COMPILE_OFF = ("compile.deepcompile", "DeepCompile's compiler passes (activation freeing and offload, prefetch "
               "scheduling) are DeepSpeed's own and zerompi does not implement them")
"""compile.deepcompile: false (the default) is accepted, with the pass options then unread (warned); true is refused."""

MONITORS: dict[str, tuple[str, ...]] = {
    "tensorboard": ("enabled", "output_path", "job_name"),
    "wandb": ("enabled", "group", "team", "project"),
    "csv_monitor": ("enabled", "output_path", "job_name"),
    "comet": ("enabled", "samples_log_interval", "project", "workspace", "api_key", "experiment_name",
              "experiment_key", "online", "mode"),
    "flops_profiler": ("enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules",
                       "detailed", "output_file"),
    "comms_logger": ("enabled", "verbose", "prof_all", "prof_ops", "debug"),
}
"""Monitoring and profiling blocks: enabled, each is named in the warning (zerompi keeps its own
metrics: the engine's counters and the jobs' metrics.jsonl); disabled, they say nothing."""

_ZERO_NO_EFFECT = {
    **dict.fromkeys(("contiguous_gradients", "reduce_scatter", "allgather_partitions", "round_robin_gradients",
                     "use_multi_rank_bucket_allreduce", "memory_efficient_linear", "override_module_apply",
                     "log_trace_cache_warnings", "enable_sanity_checks", "cpu_offload_use_pin_memory",
                     "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential"), "bool"),
    **dict.fromkeys(("sub_group_size", "stage3_max_reuse_distance", "stage3_model_persistence_threshold",
                     "stage3_module_granularity_threshold"), "size"),
}
NO_EFFECT: dict[str, str] = {
    "optimizer.params.torch_adam": "bool", "optimizer.legacy_fusion": "bool", "steps_per_print": "interval",
    "wall_clock_breakdown": "bool", "memory_breakdown": "bool", "dump_state": "bool", "prescale_gradients": "bool",
    "zero_allow_untested_optimizer": "bool", "zero_force_ds_cpu_optimizer": "bool",
    "cuda_visible_devices": "any", "bf16.immediate_grad_update": "bool", "checkpoint.tag_validation": "any",
    **{f"zero_optimization.{k}": kind for k, kind in _ZERO_NO_EFFECT.items()},
    **{f"zero_optimization.offload_param.{k}": "size" for k in ("buffer_count", "buffer_size", "max_in_cpu")},
    "zero_optimization.offload_optimizer.buffer_count": "size",
    **{f"zero_optimization.offload_optimizer.{k}": "bool" for k in ("pipeline_read", "pipeline_write", "fast_init",
                                                                    "super_offload")},
    **{f"zero_optimization.offload_optimizer.{k}": "ratio" for k in ("ratio", "cpuadam_cores_perc")},
    **{f"aio.{k}": "bool" for k in ("single_submit", "overlap_events", "use_gds")},
    "aio.queue_depth": "size", "aio.thread_count": "size",
    **{f"activation_checkpointing.{k}": "any" if k == "number_checkpoints" else "bool"
       for k in ACTIVATION_CHECKPOINTING},
}
"""Tuning, logging and memory keys that cannot change the result: accepted, checked for their type
("bool"; "size": a number >= 0; "interval": the same or inf, never (accelerate writes
``steps_per_print: inf``); "ratio": a number in [0, 1]; "any"), and named in one warning."""

SCHEMA: dict[str, Any] = {
    "zero_optimization": {
        "stage": None, "reduce_bucket_size": None, "allgather_bucket_size": None,
        "offload_optimizer": OFFLOAD_OPTIMIZER, "offload_param": OFFLOAD_PARAM, "overlap_comm": None,
        "stage3_prefetch_bucket_size": None, "stage3_param_persistence_threshold": None,
        "stage3_max_live_parameters": None, "stage3_gather_16bit_weights_on_model_save": None,
        "zero_quantized_weights": None, "zero_quantized_gradients": None, "zero_hpz_partition_size": None,
        **dict.fromkeys(_ZERO_NO_EFFECT)},
    "gradient_accumulation_steps": None, "gradient_clipping": None,
    "bf16": ("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
             "bf16_optimizer_states"),
    "fp16": ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
             "hysteresis", "min_loss_scale", "auto_cast", "consecutive_hysteresis",
             "fp16_master_weights_and_grads"),
    "optimizer": {"type": None, "legacy_fusion": None, "params": tuple(dict.fromkeys(ADAM_PARAMS + SGD_PARAMS + MUON_PARAMS))},
    "scheduler": {"type": None, "params": ALL_PARAMS},
    # Data loader settings: zerompi.deepspeed checks and derives them (batch.py); drop_last shapes the
    # DataLoader initialize builds from training_data=.
    "train_batch_size": None, "train_micro_batch_size_per_gpu": None, "dataloader_drop_last": None,
    "aio": AIO, "activation_checkpointing": ACTIVATION_CHECKPOINTING, **MONITORS,
    "checkpoint": {"tag_validation": None, "load_universal": None, "use_node_local_storage": None,
                   "parallel_write": ("pipeline_stage",)},
    "communication_data_type": None, "data_types": DATA_TYPES, "compile": COMPILE,
    **dict.fromkeys(k for k in NO_EFFECT if "." not in k),
}
"""Keys zerompi reads: None is a leaf, a tuple a block of leaves, a dict a block of blocks. Any
other key is refused: dropping a setting changes training."""

_ZERO_ALIASES = {
    "stage3_gather_16bit_weights_on_model_save": ("stage3_gather_fp16_weights_on_model_save",
                                                  "gather_16bit_weights_on_model_save"),
    **{f"stage3_{name}": (name,) for name in (
        "prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "max_reuse_distance",
        "model_persistence_threshold", "module_granularity_threshold", "use_all_reduce_for_fetch_params",
        "allgather_sequential")},
}
ALIASES: dict[str, tuple[str, ...]] = {
    "bf16": ("bfloat16",),
    **{f"zero_optimization.{new}": tuple(f"zero_optimization.{old}" for old in olds)
       for new, olds in _ZERO_ALIASES.items()},
}
"""Key -> the other spellings DeepSpeed 0.19.8 reads for it: deprecated names, and the field names
its ZeRO model accepts beside the stage3_ aliases."""

REQUIRED: dict[str, tuple[bool, str]] = {
    "fp16.auto_cast": (False, "zerompi does not cast the inputs"),
    "fp16.consecutive_hysteresis": (False, "zerompi's loss scaler does not refill hysteresis after good steps"),
    "fp16.fp16_master_weights_and_grads": (False, "zerompi keeps fp32 master weights and gradients"),
    "bf16.bf16_master_weights_and_grads": (False, "zerompi keeps fp32 master weights and gradients"),
    "bf16.bf16_optimizer_states": (False, "zerompi keeps the optimizer state in fp32"),
    "bf16.check_grad_overflow": (True, "zerompi checks every gradient for NaN/Inf and cannot apply a non-finite "
                                       "step (nonfinite='raise' or 'skip')"),
    "checkpoint.load_universal": (False, "zerompi loads its own checkpoints at any world size, not DeepSpeed's "
                                         "universal checkpoint files"),
    "checkpoint.use_node_local_storage": (False, "zerompi writes each checkpoint to the one directory "
                                                 "save_checkpoint names, which every rank must reach"),
    "checkpoint.parallel_write.pipeline_stage": (False, "zerompi has no pipeline stages"),
}
"""Switches whose only allowed value is what zerompi computes (and why): another value changes the result."""


class Feature:
    """A DeepSpeed feature zerompi does not implement: refused unless its block is disabled."""

    def __init__(self, label: str, reason: str, default_off: bool = True, removed: bool = False):
        self.label = label
        self.reason = reason + ("; DeepSpeed 0.19.8 has removed it too" if removed else "")
        self.default_off = default_off
        """Off unless ``enabled: true`` appears in the block (its own, or its techniques')."""


FEATURES: dict[str, Feature] = {
    "compression_training": Feature("compression training", "DeepSpeed Compression's quantization-aware training, "
                                    "pruning and layer reduction change the model, and zerompi does not implement "
                                    "them", removed=True),
    "data_efficiency": Feature("data efficiency", "curriculum data sampling and random layerwise token dropping "
                               "change what each step trains on; zerompi does not implement them"),
    "curriculum_learning": Feature("curriculum learning", "a sequence-length curriculum changes the batches; "
                                   "zerompi does not implement it", removed=True),
    "progressive_layer_drop": Feature("progressive layer drop", "skipping layers as training goes changes the "
                                      "result; zerompi does not implement it", removed=True),
    "eigenvalue": Feature("eigenvalue", "Hessian eigenvalue estimation drives DeepSpeed's layer-wise schedules, "
                          "which zerompi does not implement", removed=True),
    "quantize_training": Feature("quantized training", "MoQ quantizes the weights during training, which zerompi "
                                 "does not implement", removed=True),
    "elasticity": Feature("elastic training", "DeepSpeed's elastic agent picks batch and world sizes; zerompi runs "
                          "under mpiexec at a fixed size", removed=True),
    "autotuning": Feature("autotuning", "the DeepSpeed launcher's search over configs; zerompi has no launcher"),
    "hybrid_engine": Feature("hybrid engine", "DeepSpeed-Chat's inference kernels for RLHF generation, which "
                             "zerompi does not have"),
    "torch_autocast": Feature("torch autocast", "computing under torch.autocast beside fp32 parameters is other "
                              "arithmetic than zerompi's, which casts the parameters (use bf16 or fp16 instead)"),
    "pipeline": Feature("pipeline parallelism", "zerompi is data parallel only", default_off=False),
    "tensor_parallel": Feature("tensor parallelism", "AutoTP splits layers across ranks; zerompi is data parallel "
                               "only", default_off=False),
    "sparse_attention": Feature("sparse attention", "DeepSpeed's block-sparse attention kernels, which zerompi "
                                "does not have", default_off=False, removed=True),
}
"""Top-level blocks of features zerompi lacks, each refused with its reason unless ``enabled: false``. DeepSpeed
0.19.8 refuses the removed ones in any form; a disabled one changes nothing, so zerompi accepts it."""

DATA_EFFICIENCY: dict[str, tuple[str, str]] = {
    "data_sampling": ("data sampling", "DeepSpeed's data sampler draws each step's samples itself, in its own "
                      "order; zerompi trains on the batches the script's loader gives"),
    "data_sampling.curriculum_learning": ("curriculum learning", "a curriculum by difficulty or sequence length "
                                          "changes what each step trains on; zerompi does not implement it"),
    "data_sampling.dynamic_batching": ("dynamic batching", "batches sized by their token count change the "
                                       "batches; zerompi does not implement it"),
    "data_routing": ("data routing", "routing tokens past layers changes what each layer trains on; zerompi does "
                     "not implement it"),
    "data_routing.random_ltd": ("random layerwise token dropping", "dropping random tokens from the middle "
                                "layers changes the model's computation; zerompi does not implement it"),
}
"""data_efficiency's techniques (dotted paths under the block), each refused by name with its reason when
turned on (screen.py)."""

OPTIMIZER_FEATURES: dict[str, Feature] = {
    "onebitadam": Feature("1-bit Adam", "compressed optimizer communication zerompi does not implement", removed=True),
    "zerooneadam": Feature("0/1 Adam", "compressed optimizer communication with adaptive variance freezing, "
                           "which zerompi does not implement", removed=True),
    "onebitlamb": Feature("1-bit LAMB", "compressed optimizer communication and LAMB's layer-wise trust ratios, "
                          "which zerompi does not implement", removed=True),
}
"""optimizer.type values (lower case) of optimizers zerompi lacks; their params are theirs, not unknown keys."""
