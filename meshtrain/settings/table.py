"""Every Trainer setting: name, section, default, type, one-line doc, check, and what it needs to
have any effect (meshtrain.settings reads this table; the kinds of value and the words of a need
are in meshtrain/settings/kinds.py)."""

from __future__ import annotations

from meshtrain.errors import ConfigError
from meshtrain.settings.kinds import Setting


# -- checks that are more than a type: each names its setting ---------------------------------
def _check_loggers(value) -> None:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        raise ConfigError(f"loggers must be a list of logger names ({_LOGGER_NAMES}), "
                          f"got {value!r}")
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(f"unknown logger {name!r} in loggers; choose from {_LOGGER_NAMES} "
                              "(or an empty list for none)")
        if name in ("mlflow", "wandb"):  # optional extras: is the package there? (no import)
            from meshtrain.observe.loggers.external import missing_package

            message = missing_package(name)
            if message is not None:
                raise ConfigError(f"loggers: {message}")


def _check_callbacks(value) -> None:
    from meshtrain.callbacks import Callback
    from meshtrain.module.hooks import check_callback

    for item in value:
        if not isinstance(item, Callback):
            kind = type(item).__name__
            ours = kind in ("EarlyStopping", "ModelCheckpoint", "LearningRateMonitor", "EMA")
            lightning = type(item).__module__.split(".")[0] in ("lightning",
                                                                 "pytorch_lightning")
            raise ConfigError(
                f"callbacks must be Callback objects (subclasses of meshtrain.Callback), got "
                f"{kind}" + (f" from {type(item).__module__}: use meshtrain.{kind}, which takes "
                             "Lightning's arguments" if lightning and ours else
                             " (Lightning's): write it as a meshtrain.Callback, whose hooks take "
                             "(trainer, ...) (docs/lightning.md)" if lightning else ""))
        check_callback(item)


def _check_resume(value) -> None:
    from meshtrain.checkpoint.resume import check_resume  # does the folder hold a checkpoint?

    check_resume(value)


def _check_metrics(value) -> None:
    from meshtrain.metrics import resolve

    resolve(value)


def _check_float8(value) -> None:
    from meshtrain.parallel.float8 import check_torchao  # installed? (no import of torchao)

    check_torchao()


def _check_init_from(value) -> None:
    from meshtrain.checkpoint.hf_weights import weight_files  # safetensors in the folder?

    weight_files(value)


# The choices, as the modules that implement them define them (tests/test_settings.py checks
# they agree).
ACCELERATORS = ("auto", "cpu", "cuda", "gpu")  # "gpu": Lightning's name for "cuda"
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
FLOAT8_RECIPES = ("tensorwise", "rowwise")
COMM_HOOKS = ("fp16", "bf16", "powersgd")
OFFLOADS = ("cpu",)
ACTIVATION_CHECKPOINTING = ("full", "selective")
COMPILE_MODES = ("blocks", "model")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zero-bubble", "zbv",
                "dualpipev")
PP_BALANCES = ("params", "time", "memory")
LOCAL_COMM = ("auto", "backend")
NAN_POLICIES = ("error", "skip", "rollback")
LOGGERS = ("csv", "tensorboard", "mlflow", "wandb")
_LOGGER_NAMES = ", ".join(repr(name) for name in LOGGERS)
# what the settings of periodic checkpoints need: one of them
_PERIODIC = "checkpoint_every_n_steps|checkpoint_every_n_epochs|checkpoint_every_n_minutes"

_S = Setting
DEFINITIONS = [
    # -- trainer ------------------------------------------------------------------------------
    _S("layout", "trainer", None, "layout",
       'The parallel layout over the mesh, e.g. "dp=2", "zero3=4", "pp=2,dp_shard=2,tp=2" (a '
       "string, a table/dict or a Layout; see docs/model_parallel.md); none: data parallel over "
       'all processes; "auto" (or "auto,tp=2" to pin axes): the planner picks the layout and the '
       "settings it plans (docs/planner.md).", none=True),
    _S("plan_cluster", "trainer", None, "choice",
       'The machines layout="auto" plans for: "8xH100", "8xH200" or "this-machine"; none: '
       "this machine measured on CPU, the GPU's preset by its name.",
       choices=("8xH100", "8xH200", "this-machine"), none=True, needs=("layout=auto",)),
    _S("devices", "trainer", 1, "devices",
       "Processes on this machine when started with plain python; under meshtrain run/torchrun "
       'the launcher decides and this must match or be "auto".',
       error="devices must be a positive integer or 'auto', got {value!r}"),
    _S("accelerator", "trainer", "auto", "choice",
       '"cpu", "cuda" (or Lightning\'s "gpu") or "auto" (a GPU when one is visible).',
       choices=ACCELERATORS,
       error="accelerator must be 'cpu', 'cuda' ('gpu') or 'auto', got {value!r}"),
    _S("max_steps", "trainer", None, "int",
       "Stop after this many optimizer steps (with max_epochs: the first reached; neither "
       "set: one epoch).",
       none=True, minimum=1),
    _S("max_epochs", "trainer", None, "int",
       "Stop after this many passes over the training data.", none=True, minimum=1),
    _S("max_time_minutes", "trainer", None, "number",
       "Stop at the first logging interval past this much training time (rank 0's clock), "
       "with a checkpoint from which running the job again continues; none: no limit.",
       none=True),
    _S("global_batch_size", "trainer", 32, "int",
       "Samples per optimizer step over all ranks (= dp x micro_batch_size x accumulation); "
       "unset, a DataLoader given as training data lends its batch_size.",
       minimum=1),
    _S("micro_batch_size", "trainer", None, "int",
       "Samples per forward pass on one rank; none: as large as possible (no accumulation), "
       "under pp one micro-batch per stage.", none=True, minimum=1),
    _S("grad_clip_norm", "trainer", None, "number",
       "Clip the gradients by their global L2 norm (over every shard and stage); none: no "
       "clipping.", none=True),
    _S("precision", "trainer", "fp32", "choice",
       '"fp32", "bf16-mixed" or "fp16-mixed" (float16 autocast with a grad scaler; CPU and '
       "GPU). Parity with fp32: docs/precision.md.",
       choices=PRECISIONS,
       error="unknown precision {value!r}; choose one of fp32, bf16-mixed, fp16-mixed"),
    _S("float8", "trainer", None, "choice",
       'Train the nn.Linear layers whose sizes are multiples of 16 (not the output head) in '
       'float8 through torchao: "tensorwise" (a scale per tensor; under zero2/zero3 weights '
       'all-gathered in float8) or "rowwise" (a scale per row); with fp32 or bf16-mixed, '
       "under every layout and compile. Needs a CUDA GPU of compute capability >= 8.9 (or "
       "float8_emulate) and pip install 'meshtrain[float8]'; none: off (docs/precision.md).",
       choices=FLOAT8_RECIPES, none=True, check=_check_float8,
       error="unknown float8 recipe {value!r}; choose one of tensorwise, rowwise or None"),
    _S("float8_emulate", "trainer", False, "bool",
       "float8 in torchao's emulation: the same float8 casts and scales, the matmuls in high "
       "precision, on any device (CPU included); for checking numerics, not for speed.",
       needs=("float8",)),
    _S("seed", "trainer", 0, "int",
       "Seeds Python's random, NumPy and torch when the Trainer is built (a model object built "
       "after it starts the same on every rank and in one process), a factory's model, the data "
       "order and each rank's dropout (alike on the ranks of a tp or cp group, which compute "
       "the same samples; loader workers alike on the ranks that read the same samples). Ranks "
       "whose models still differ get rank 0's weights, with a warning. Not given: the seed of "
       "a torch.manual_seed(N) made before the Trainer (N below 2**32; said at start) or of "
       "lightning.seed_everything(N), else 0. Every rank must have the same seed (checked "
       "at start)."),
    _S("shuffle", "trainer", True, "bool",
       "Shuffle the training data each epoch (one seeded order, independent of the number of "
       "ranks); unset, a DataLoader given as training data lends its own (shuffle=)."),
    _S("val_every_n_steps", "trainer", None, "int",
       "Validate every N optimizer steps and at the end of fit; none: at the end only.",
       none=True, minimum=1),
    _S("val_every_n_epochs", "trainer", None, "int",
       "Validate at the end of every N-th training epoch and at the end of fit (Lightning's "
       "check_val_every_n_epoch); none: as val_every_n_steps says.", none=True, minimum=1),
    _S("limit_train_batches", "trainer", None, "int",
       "Train on the first N global batches (optimizer steps) of each epoch's order, a new "
       "order each epoch (Lightning's limit_train_batches as a count); none: whole epochs. "
       "Map-style datasets.", none=True, minimum=1),
    _S("limit_val_batches", "trainer", None, "int",
       "Validate on the first this-many x global_batch_size samples of the validation set (the "
       "same samples under any layout); none: all of them. test() always sees all.",
       none=True, minimum=1),
    _S("metrics", "trainer", (), "metrics",
       'Validation and test metrics besides the loss: "perplexity", "token_accuracy" or '
       "meshtrain.metrics.Metric objects; reduced over every rank (docs/llm.md).",
       check=_check_metrics),
    _S("num_workers", "trainer", 0, "int",
       "DataLoader worker processes per rank (for data given as a Dataset).", minimum=0),
    _S("callbacks", "trainer", (), "callbacks",
       "Callback objects (EarlyStopping, ModelCheckpoint, LearningRateMonitor or your own; see "
       "Callbacks below).", check=_check_callbacks, config=False),
    # -- parallel -----------------------------------------------------------------------------
    _S("bucket_cap_mb", "parallel", None, "number",
       "DDP gradient bucket size in MiB; none: 25.", none=True, needs=("ddp",)),
    _S("comm_hook", "parallel", None, "choice",
       'DDP communication hook: "fp16" or "bf16" (compressed all-reduce) or "powersgd" '
       "(low-rank); none: plain all-reduce.",
       choices=COMM_HOOKS, none=True, needs=("ddp",),
       error="unknown comm_hook {value!r}; choose one of fp16, bf16, powersgd or None"),
    _S("powersgd_rank", "parallel", 1, "int",
       "Rank of PowerSGD's low-rank gradient approximation.", minimum=1,
       needs=("comm_hook=powersgd",)),
    _S("offload", "parallel", None, "choice",
       '"cpu": keep the sharded parameters, gradients and optimizer state in CPU memory (a '
       "sharded layout on GPUs); none: no offload.", choices=OFFLOADS, none=True,
       needs=("sharded",), error="unknown offload {value!r}; choose None (no offload) or 'cpu'"),
    _S("local_comm", "parallel", "auto", "choice",
       'How CPU processes of one host pass pipeline activations and gradients, FSDP\'s '
       "shards and the tp axis's all-reduces, all-gathers and reduce-scatters: \"auto\" "
       "through shared memory (meshtrain/parallel/shm/p2p.py, shm/collectives.py; gloo's "
       "send/recv cost 0.1-0.4 ms each to post) when the job runs on gloo and every rank can "
       'map the same /dev/shm, else the process group\'s own collectives; "backend": always '
       "the latter.", choices=LOCAL_COMM, needs=("pp|tp|sharded",),
       error="local_comm must be 'auto' or 'backend', got {value!r}"),
    _S("shard_unit_mb", "parallel", 4.0, "number",
       "Sharded layouts: consecutive blocks are sharded together until a unit holds this many "
       "MiB of parameters, so each all-gather and reduce-scatter moves a useful size; none: "
       "one unit per block.", none=True, needs=("sharded",)),
    _S("activation_checkpointing", "parallel", None, "choice",
       '"full" recomputes each block\'s activations in backward, "selective" only the cheap '
       "element-wise ones (matmul and attention outputs are kept); none: off.",
       choices=ACTIVATION_CHECKPOINTING, none=True,
       error="activation_checkpointing must be 'full', 'selective' or None, got {value!r}"),
    _S("compile", "parallel", False, "choice",
       'torch.compile (Inductor): True or "blocks" compiles each repeated block, "model" the '
       "whole forward (not with activation_checkpointing); applied after tp, cp and "
       "checkpointing, before DDP/FSDP2, under every layout (docs/compile.md).",
       choices=(False, True) + COMPILE_MODES,
       error="compile must be True, False, 'blocks' or 'model', got {value!r}"),
    _S("blocks", "parallel", None, "callable",
       "A function model -> the submodules sharded (and checkpointed) one by one; none: the "
       "model's repeated blocks (e.g. model.layers).", none=True, config=False,
       needs=("sharded|activation_checkpointing|compile",),
       error="blocks must be a function (model -> iterable of modules) or None, got {value!r}"),
    _S("meta_init", "parallel", "auto", "choice",
       "Build a sharded or tensor-parallel model given as a factory on the meta device and "
       'let each rank initialise only its shards (needs init_weights()); "auto": whenever '
       "possible (else the start says that each rank builds the whole model).",
       choices=(True, False, "auto"), needs=("sharded|tp",),
       error="meta_init must be True, False or 'auto', got {value!r}"),
    _S("sequence_parallel", "parallel", False, "bool",
       "Tensor parallel: norms and dropout work on sequence shards (the sequence length must "
       "divide by tp).", needs=("tp",)),
    _S("loss_parallel", "parallel", False, "bool",
       "Tensor parallel: keep the logits sharded over the vocabulary and compute the "
       "cross-entropy on the shards.", needs=("tp",)),
    _S("local_sgd_every", "parallel", None, "int",
       "Local SGD: each dp rank steps on its own gradients and the parameters are averaged "
       "every H steps (and when training ends) instead of the gradients every step "
       "(docs/parameter_server.md).", none=True, minimum=1, needs=("plain_dp",)),
    _S("outer_lr", "parallel", None, "number",
       "DiLoCo's outer step for local SGD: Nesterov SGD on the averaged change, at this rate "
       "(DiLoCo: 0.7); none: plain averaging.", none=True, needs=("local_sgd_every",)),
    _S("outer_momentum", "parallel", 0.9, "number",
       "Momentum of local SGD's outer step.", needs=("outer_lr",)),
    _S("ps_mode", "parallel", "sync", "choice",
       'Parameter servers (layout "ps=S,dp=W"): "sync" (the servers step once every worker '
       'pushed; equal to one process) or "async" (each push applied on arrival, bounded by '
       "ps_staleness; docs/parameter_server.md).", choices=("sync", "async"), needs=("ps",)),
    _S("ps_staleness", "parallel", None, "int",
       'Async parameter servers: a worker may run at most this many steps ahead of the slowest '
       "(stale synchronous parallel); none: no bound.", none=True,
       needs=("ps", "ps_mode=async")),
    _S("sync_batchnorm", "parallel", True, "bool",
       "BatchNorm statistics over the micro-batches of every data-parallel rank together (as "
       "one process on the global micro-batch); False: per rank, not layout-invariant.",
       needs=("batch",)),
    _S("tp_plan", "parallel", None, "tp_plan",
       "Your own tensor-parallel plan (module name -> ParallelStyle), used instead of the "
       "model's tp_plan().", none=True, config=False, needs=("tp",)),
    _S("tp_check_steps", "parallel", 1, "int",
       "Tensor parallel: in the first N steps, check that every parameter replicated over the "
       "tp ranks got the same gradient on each, and that every module declared to see split "
       "activations (ReplicateParallel(local_input=True)) saw them (small all-reduces), so a "
       "wrong plan stops with the module named instead of training differently; 0: off.",
       minimum=0,
       needs=("tp",)),
    # -- pipeline -----------------------------------------------------------------------------
    _S("pp_schedule", "pipeline", "1f1b", "choice",
       "Pipeline schedule (torch.distributed.pipelining): gpipe, 1f1b, interleaved-1f1b, "
       "looped-bfs, zero-bubble (several stages per rank), zbv, dualpipev (two per rank, V).",
       choices=PP_SCHEDULES, needs=("pp",),
       error="unknown pipeline schedule {value!r} (pp_schedule); choose one of "
             + ", ".join(PP_SCHEDULES)),
    _S("stages_per_rank", "pipeline", 1, "int",
       "Pipeline stages on each rank (2 or more for the interleaved schedules, 2 for zbv and "
       "dualpipev).", minimum=1, needs=("pp",)),
    _S("pp_balance", "pipeline", "params", "choice",
       'How the blocks are cut into stages of equal cost: "params" (parameter count), "time" '
       '(measured forward+backward) or "memory" (parameters plus saved activations).',
       choices=PP_BALANCES, needs=("pp", "not split_points"),
       error="pp_balance must be 'params', 'time' or 'memory', got {value!r}"),
    _S("split_points", "pipeline", None, "int_list",
       "Cut points given by hand: the first block index of stages 1, 2, ... (e.g. [3, 6]); "
       "none: from pp_balance.", none=True, needs=("pp",)),
    # -- checkpoint ---------------------------------------------------------------------------
    _S("checkpoint_every_n_steps", "checkpoint", None, "int",
       "Save a checkpoint every N optimizer steps into run_dir/checkpoints/step_*; none: no "
       "periodic checkpoints.", none=True, minimum=1),
    _S("checkpoint_every_n_epochs", "checkpoint", None, "int",
       "Save a checkpoint at the end of every Nth epoch (run_dir/checkpoints/step_*, where a "
       "resumed run starts the next epoch); none: off.", none=True, minimum=1),
    _S("checkpoint_every_n_minutes", "checkpoint", None, "number",
       "Save a checkpoint when this many minutes have passed since the last one; none: off.",
       none=True,
       error="checkpoint_every_n_minutes must be a number > 0 or None, got {value!r}"),
    _S("keep_last_k", "checkpoint", None, "int",
       "Keep only the newest k periodic checkpoints; none: keep all.", none=True, minimum=1,
       needs=(_PERIODIC,)),
    _S("async_checkpoint", "checkpoint", False, "bool",
       "Write periodic checkpoints in the background: the state is copied to reused host "
       "buffers while the next step computes (its optimizer update waits for the copy), then "
       "written by DCP in a background thread (torch's DefaultStager and async_save).",
       needs=(_PERIODIC,)),
    _S("resume", "checkpoint", "auto", "resume",
       '"auto": continue the newest unfinished run of this job and model (root_dir/name), or '
       "run_dir's newest checkpoint; a checkpoint folder; none: start afresh.", none=True,
       check=_check_resume,
       error="resume must be 'auto', None or a checkpoint folder, got {value!r}"),
    _S("init_from", "checkpoint", None, "path",
       "A Hugging Face model folder (config.json + safetensors) whose weights initialise the "
       "model once the layout is applied, each rank reading only its shards (a resumed "
       "checkpoint replaces them); none: the model's own initialisation.", none=True,
       check=_check_init_from),
    _S("save_final_checkpoint", "checkpoint", True, "bool",
       "Save run_dir/checkpoints/final at the end of fit."),
    _S("stop_on_signal", "checkpoint", "auto", "choice",
       "A signal that makes every rank stop after the same step (the one under way, or with "
       "several ranks the next) with a resumable checkpoint (checkpoints/final); under Slurm "
       "the job is then requeued. \"auto\": SIGUSR1 in one process or under Slurm (several "
       "processes agree on the step through a one-int gloo all-reduce per step, in the "
       "background); none: off.", choices=("auto", "SIGUSR1", "SIGUSR2"), none=True,
       error="stop_on_signal must be 'auto', 'SIGUSR1', 'SIGUSR2' or None, got {value!r}"),
    # -- fault --------------------------------------------------------------------------------
    _S("nan_policy", "fault", "error", "choice",
       'What a NaN/Inf loss or gradient does (every rank alike): "error" stops, "skip" drops '
       'the update, "rollback" restores the last checkpoint and skips the batch; none: no check.',
       choices=NAN_POLICIES, none=True,
       error="nan_policy must be one of 'error', 'skip', 'rollback' or None, got {value!r}"),
    _S("collective_timeout_s", "fault", 300.0, "number",
       "After the first step a collective waiting this long raises instead of hanging (must "
       "exceed the slowest checkpoint write; in one process it only bounds stall_timeout_s).",
       needs=("processes|stall_timeout_s",)),
    _S("init_timeout_s", "fault", 600.0, "number",
       "Collective timeout for start-up and the first step.", needs=("processes",)),
    _S("stall_timeout_s", "fault", 120.0, "number",
       "A step running this long ends the job naming the rank that stopped advancing, with "
       "every rank's stacks in run_dir/stacks/ (below collective_timeout_s); none: no watchdog.",
       none=True),
    _S("debug_collectives", "fault", False, "bool",
       "Check every collective across ranks first and name the ranks and call sites of a "
       "desync (a few ms per collective: for debugging).", needs=("processes",)),
    _S("sdc_check_every_n_steps", "fault", None, "int",
       "Every N steps each rank computes its first micro-batch's gradients again and compares "
       "them bit for bit with the step's (a 64-bit positional checksum per parameter): a "
       "difference is silent data corruption, named by rank and step and handled by "
       "nan_policy; costs one more forward and backward of a micro-batch every N steps. One "
       "process and dp/zero1 (docs/fault_tolerance.md); none: off.", none=True, minimum=1,
       needs=("replayable",)),
    _S("mtbf_hours", "fault", 3.0, "number",
       "Expected hours between failures, for the Young/Daly checkpoint interval fit prints "
       "at the first periodic checkpoint.",
       needs=("checkpoint_every_n_steps|checkpoint_every_n_minutes",)),
    # -- logging ------------------------------------------------------------------------------
    _S("log_every_n_steps", "logging", 10, "int",
       "How often the loss is averaged over ranks and logged.", minimum=1),
    _S("log_grad_norm", "logging", False, "bool",
       "Log train/grad_norm, the global L2 norm of the gradients before clipping (over every "
       "shard and stage)."),
    _S("loggers", "logging", ("csv", "tensorboard"), "loggers",
       "Where metrics go: metrics.csv (and loss.png), TensorBoard event files, MLflow (a local "
       "store in the run folder's mlruns/ unless MLFLOW_TRACKING_URI is set) and/or Weights & "
       "Biases (run folder's wandb/, offline without WANDB_API_KEY); mlflow and wandb need "
       "pip install 'meshtrain[loggers]'.", choices=LOGGERS, check=_check_loggers),
    _S("progress_bar", "logging", True, "bool", "Show a progress bar on rank 0."),
    _S("model_summary", "logging", True, "bool",
       "Print each top-level module's parameters at the start of fit, and how many each rank "
       "holds under the layout."),
    _S("report", "logging", True, "bool",
       "Write run_dir/report.html at the end of fit (also after a failure): loss, throughput "
       "and MFU, each rank's step-time breakdown and memory, events; `meshtrain report "
       "RUN_DIR` writes it at any time."),
    _S("breakdown_every_n_steps", "logging", 1, "int",
       "Measure where every Nth step's time goes on each rank (data, compute, comm, bubble, "
       "optimizer, checkpoint, other) for breakdown.csv and the report (on a GPU from CUDA "
       "events, without waiting for the device); none: off.", minimum=1, none=True),
    _S("straggler_margin", "logging", 0.2, "number",
       "Warn when a rank's own work per step (its step minus its waits for the others) stays "
       "this fraction above the other ranks' median, and beyond their spread and 3x its own "
       "jitter, for three logging intervals in a row (measured with breakdown_every_n_steps); "
       "none: never.", none=True,
       needs=("ranks", "breakdown_every_n_steps!=None")),
    _S("profile_steps", "logging", (), "steps",
       "Optimizer steps to trace with the torch profiler (from the first listed to the last): "
       "a Chrome trace per rank in run_dir/traces/, linked from the report (on CUDA also a "
       "memory snapshot per rank, for pytorch.org/memory_viz)."),
    _S("peak_tflops", "logging", None, "number",
       "One device's peak TFLOP/s for MFU; none: a GPU's dense bf16 peak from meshtrain's "
       "table (H100, H200, B200, ...), on CPU a matmul measured on rank 0.", none=True),
    _S("root_dir", "logging", "runs", "path",
       "Run folders go to root_dir/name/<time> (unless run_dir is given)."),
    _S("name", "logging", "auto", "str", 'The job\'s name: its runs go to root_dir/name/; "auto": '
       "the script's file name (train.py: train), or the config's under `meshtrain train`."),
    _S("run_dir", "logging", None, "path",
       "Where this run's logs and checkpoints go; none: root_dir/name/<time> (or the folder of "
       "the run being resumed).", none=True),
]
del _S

