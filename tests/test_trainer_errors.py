"""Bad inputs fail with a ConfigError at Trainer() or fit(), before any process group exists."""

import pytest
import torch
import torch.distributed as dist
from conftest import trainer_kwargs
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from meshtrain import ConfigError, LayoutError, Trainer


def _data(n=32):
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=gen), torch.randn(n, 2, generator=gen))


def _model():
    return torch.nn.Linear(4, 2)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _kwargs(tmp_path, **overrides):
    return trainer_kwargs(tmp_path / "run", **{"max_steps": 2, "global_batch_size": 8, **overrides})


@pytest.fixture(autouse=True)
def _no_process_group_before_or_after():
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized(), "a process group was created before the error"


@pytest.fixture
def world_of_two(monkeypatch):
    """Look like rank 0 of a 2-process job started by a launcher (nothing is started)."""
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)


def _fit_raises(trainer_kwargs, match, *, model=_model, data=None, optimizer=_sgd, **fit_kwargs):
    trainer = Trainer(**trainer_kwargs)
    with pytest.raises(ConfigError, match=match):
        trainer.fit(model, _data() if data is None else data, optimizer=optimizer,
                    loss_fn=torch.nn.functional.mse_loss, **fit_kwargs)
    assert not trainer_kwargs["run_dir"].exists(), "fit created the run folder before failing"
    return trainer


# ---- Trainer(...) -------------------------------------------------------------------------------
def test_constructor_does_not_create_a_process_group(world_of_two, tmp_path):
    trainer = Trainer(**_kwargs(tmp_path, global_batch_size=8))
    assert trainer.world_size == 2 and trainer.layout.batch_degree == 2
    assert trainer.micro_batch_size == 4 and trainer.grad_accum_steps == 1


def test_global_batch_not_divisible_by_dp(world_of_two, tmp_path):
    with pytest.raises(ConfigError, match="does not divide over 2 data-parallel ranks.*of 2"):
        Trainer(**_kwargs(tmp_path, global_batch_size=7))


def test_global_batch_not_divisible_by_dp_times_micro(world_of_two, tmp_path):
    with pytest.raises(ConfigError) as info:
        Trainer(**_kwargs(tmp_path, global_batch_size=12, micro_batch_size=4))
    message = str(info.value)
    assert "2 x 4 = 8" in message
    assert "multiple of 8" in message and "divides 6" in message  # the two ways to fix it


def test_divisible_by_dp_times_micro_is_accepted(world_of_two, tmp_path):
    trainer = Trainer(**_kwargs(tmp_path, global_batch_size=16, micro_batch_size=4))
    assert trainer.grad_accum_steps == 2


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_non_positive_or_non_integer_max_steps(tmp_path, value):
    with pytest.raises(ConfigError, match="max_steps must be a positive integer"):
        Trainer(**_kwargs(tmp_path, max_steps=value))


def test_max_epochs_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="max_epochs must be a positive integer"):
        Trainer(**_kwargs(tmp_path, max_steps=None, max_epochs=0))


def test_neither_max_steps_nor_max_epochs_trains_one_epoch(tmp_path, capsys):
    """A bare Trainer() trains one pass over the data (it was refused), and says so."""
    trainer = Trainer(**_kwargs(tmp_path, max_steps=None, global_batch_size=8))
    assert (trainer.max_steps, trainer.max_epochs) == (None, 1)
    trainer.fit(torch.nn.Linear(2, 1), TensorDataset(torch.randn(40, 2), torch.randn(40, 1)),
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                loss_fn=torch.nn.functional.mse_loss)
    assert trainer.global_step == 5 and trainer.current_epoch == 0
    assert "stop: max_epochs=1 (neither max_steps nor max_epochs was set)" in \
        capsys.readouterr().out


def test_unknown_precision(tmp_path):
    with pytest.raises(ConfigError, match="unknown precision 'fp8'.*fp32, bf16-mixed, fp16-mixed"):
        Trainer(**_kwargs(tmp_path, precision="fp8"))


def test_fp16_mixed_on_cpu_is_accepted(tmp_path):
    # CPU autocast and GradScaler("cpu") support float16 (tests/test_mixed_precision.py trains)
    Trainer(**_kwargs(tmp_path, precision="fp16-mixed", accelerator="cpu"))


def test_lightnings_gpu_accelerator_means_cuda(tmp_path, monkeypatch):
    from meshtrain.checks import resolve_accelerator

    with pytest.raises(ConfigError, match="accelerator='gpu' but no GPU is visible"):
        Trainer(**_kwargs(tmp_path, accelerator="gpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_accelerator("gpu") == resolve_accelerator("cuda") == "cuda"
    with pytest.raises(ConfigError, match=r"'cpu', 'cuda' \('gpu'\) or 'auto', got 'tpu'"):
        Trainer(**_kwargs(tmp_path, accelerator="tpu"))


def test_bad_comm_hook_name(tmp_path):
    with pytest.raises(ConfigError, match="unknown comm_hook 'int8'.*fp16, bf16, powersgd"):
        Trainer(**_kwargs(tmp_path, comm_hook="int8"))


def test_devices_mismatching_the_launcher(world_of_two, tmp_path):
    with pytest.raises(ConfigError, match="devices=4.*started 2 processes.*devices='auto'"):
        Trainer(**_kwargs(tmp_path, devices=4))


@pytest.mark.parametrize("devices", ["auto", 1, 2])
def test_devices_agreeing_with_the_launcher(world_of_two, tmp_path, devices):
    assert Trainer(**_kwargs(tmp_path, devices=devices)).world_size == 2


def test_layout_not_matching_the_world(world_of_two, tmp_path):
    with pytest.raises(LayoutError, match="needs 4 processes"):
        Trainer(**_kwargs(tmp_path, layout="dp=4"))


def test_unknown_logger(tmp_path):
    with pytest.raises(ConfigError, match="unknown logger 'neptune'"):
        Trainer(**_kwargs(tmp_path, loggers=("csv", "neptune")))


# ---- fit(...) -----------------------------------------------------------------------------------
def test_optimizer_factory_that_returns_none(tmp_path):
    def forgot_return(params):
        torch.optim.SGD(params, lr=0.1)

    _fit_raises(_kwargs(tmp_path), r"returned NoneType.*forget `return`", optimizer=forgot_return)


def test_optimizer_factory_that_raises(tmp_path):
    def broken(params):
        return torch.optim.SGD(params, lr=-1.0)

    _fit_raises(_kwargs(tmp_path), "optimizer factory failed on a test parameter", optimizer=broken)


def test_optimizer_instance_instead_of_a_factory(tmp_path):
    instance = torch.optim.SGD(_model().parameters(), lr=0.1)
    _fit_raises(_kwargs(tmp_path), "must be a factory, not an optimizer instance.*lambda params",
                optimizer=instance)


def test_lr_scheduler_that_is_not_callable(tmp_path):
    _fit_raises(_kwargs(tmp_path), "lr_scheduler must be callable", lr_scheduler=3)


def test_model_that_is_not_a_module(tmp_path):
    _fit_raises(_kwargs(tmp_path), "model must be a torch.nn.Module", model=42)


def test_a_factory_that_fails_on_its_own_config_is_refused_before_any_process(world_of_two,
                                                                               tmp_path):
    """A Phi-3 config with the library's default pad_token_id (32000) outside a small vocabulary
    fails on meta as it would on every rank: refused before any process group, saying why."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2)
    _fit_raises(_kwargs(tmp_path), "model factory failed.*Padding_idx must be within",
                model=lambda: transformers.Phi3ForCausalLM(config))


def test_a_factory_that_cannot_build_on_meta_still_trains(tmp_path):
    """A factory that reads a value (``.item()``) cannot run on meta; that is no reason to
    refuse it: it is built for real, as before."""
    def factory():
        model = _model()
        if model.weight.abs().sum().item() == 0:
            model.weight.data.fill_(1.0)
        return model

    trainer = Trainer(**_kwargs(tmp_path))
    trainer.fit(factory, _data(), optimizer=_sgd, loss_fn=torch.nn.functional.mse_loss)
    assert trainer.global_step == 2


class _Stream(IterableDataset):
    def __init__(self, length=None):
        self.length = length

    def __iter__(self):
        yield from _data()

    def __len__(self):
        if self.length is None:
            raise TypeError("no length")
        return self.length


@pytest.mark.parametrize("wrap", [lambda d: d, lambda d: DataLoader(d, batch_size=4)])
def test_stream_without_a_length_needs_max_steps(tmp_path, wrap):
    _fit_raises(_kwargs(tmp_path, max_steps=None, max_epochs=1), "without __len__.*set max_steps",
                data=wrap(_Stream()))


def test_stream_shorter_than_one_global_batch(tmp_path):
    _fit_raises(_kwargs(tmp_path, global_batch_size=16), "has 10 items, fewer than one global",
                data=_Stream(length=10))


def test_dataset_smaller_than_one_global_batch(tmp_path):
    _fit_raises(_kwargs(tmp_path, global_batch_size=16), "has 10 samples, fewer than one global "
                "batch of 16", data=_data(10))


def test_empty_dataset(tmp_path):
    _fit_raises(_kwargs(tmp_path), "train_data is empty", data=_data(0))


def test_missing_checkpoint(tmp_path):
    # resume is the one way to name the checkpoint to start from (fit has no ckpt_path)
    with pytest.raises(ConfigError, match="resume=.* does not exist"):
        Trainer(**_kwargs(tmp_path, resume=tmp_path / "no-such-checkpoint"))
    assert not (tmp_path / "run").exists()


def test_dataset_smaller_than_one_global_batch_on_two_ranks(world_of_two, tmp_path):
    # the check uses the global batch (over both ranks), not one rank's share
    _fit_raises(_kwargs(tmp_path, global_batch_size=16), "fewer than one global batch",
                data=_data(12))


# ---- sharded layouts ----------------------------------------------------------------------------
def test_shard_degree_that_does_not_divide_the_world(world_of_two, tmp_path):
    with pytest.raises(LayoutError, match="world size is 2"):
        Trainer(**_kwargs(tmp_path, layout="zero3=4"))
    with pytest.raises(LayoutError, match="needs dp_shard.*write dp=2"):
        Trainer(**_kwargs(tmp_path, layout="dp_replicate=2,dp_shard=1"))


def test_cpu_offload_without_a_gpu_is_refused(world_of_two, tmp_path):
    with pytest.raises(ConfigError, match="no GPU"):
        Trainer(**_kwargs(tmp_path, layout="zero3=2", offload="cpu"))
    with pytest.raises(ConfigError, match="offload"):
        Trainer(**_kwargs(tmp_path, layout="zero3=2", offload="disk"))


def test_model_without_parameters_to_shard(world_of_two, tmp_path):
    _fit_raises(_kwargs(tmp_path, layout="zero3=2"), "no trainable parameters.*shard",
                model=lambda: torch.nn.ReLU())


def test_activation_checkpointing_needs_blocks(world_of_two, tmp_path):
    _fit_raises(_kwargs(tmp_path, layout="zero3=2", activation_checkpointing="full"),
                "repeated blocks.*blocks=", model=_model)
    with pytest.raises(ConfigError, match="'full', 'selective' or None"):
        Trainer(**_kwargs(tmp_path, activation_checkpointing="everything"))


# ---- pipeline and tensor parallel -----------------------------------------------------------------
def _gpt(num_layers=2, num_heads=2, vocab=16):
    from meshtrain.models.gpt import GPT, GPTConfig

    return lambda: GPT(GPTConfig(vocab_size=vocab, seq_len=8, num_layers=num_layers,
                                 num_heads=num_heads, d_model=16))


def _tokens(n=32):
    tokens = torch.randint(0, 16, (n, 9), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _lm_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _fit_lm_raises(trainer_kwargs, match, model):
    trainer = Trainer(**trainer_kwargs)
    with pytest.raises(ConfigError, match=match):
        trainer.fit(model, _tokens(), optimizer=_sgd, loss_fn=_lm_loss)


def test_more_stages_than_blocks(world_of_two, tmp_path):
    _fit_lm_raises(_kwargs(tmp_path, layout="pp=2", pp_schedule="interleaved-1f1b",
                           stages_per_rank=2), "4 stages but the model has only 2 blocks",
                   _gpt(num_layers=2))


def test_micro_batches_must_divide_the_batch(world_of_two, tmp_path):
    with pytest.raises(ConfigError, match="not a multiple of"):
        Trainer(**_kwargs(tmp_path, layout="pp=2", global_batch_size=8, micro_batch_size=3))


def test_interleaved_needs_micro_batches_a_multiple_of_pp(world_of_two, tmp_path):
    # 8 samples in micro-batches of 8/3 do not exist; 1 micro-batch of 8 is not a multiple of 2
    _fit_lm_raises(_kwargs(tmp_path, layout="pp=2", pp_schedule="interleaved-1f1b",
                           stages_per_rank=2, micro_batch_size=8), "multiple of",
                   _gpt(num_layers=4))


def test_pipeline_needs_a_loss_function(world_of_two, tmp_path):
    trainer = Trainer(**_kwargs(tmp_path, layout="pp=2"))
    with pytest.raises(ConfigError, match="pipeline layouts need loss_fn"):
        trainer.fit(_gpt(), _tokens(), optimizer=_sgd)


def test_tp_must_divide_the_heads(world_of_two, tmp_path):
    _fit_lm_raises(_kwargs(tmp_path, layout="tp=2"), "num_heads", _gpt(num_heads=1))
    _fit_lm_raises(_kwargs(tmp_path, layout="tp=2"), "vocab_size", _gpt(vocab=17))


def test_tp_without_a_plan_is_refused_before_any_process_group(world_of_two, tmp_path):
    # a Linear supplies no tp_plan of its own: the message says how to give one
    _fit_raises(_kwargs(tmp_path, layout="tp=2"),
                r"Linear has no tensor-parallel plan: pass Trainer\(tp_plan=")


@pytest.mark.parametrize("overrides, match", [
    (dict(layout="zero3=2", comm_hook="fp16"),
     r"comm_hook='fp16' is a DDP setting, but the layout dp_shard=2 does not use DDP \(FSDP"),
    (dict(layout="zero2=2", bucket_cap_mb=10), r"bucket_cap_mb=10 is a DDP setting.*zero2=2"),
    (dict(layout="pp=2", comm_hook="bf16"), r"layout pp=2 does not use DDP"),
    (dict(layout="dp=2", powersgd_rank=2), r"powersgd_rank=2 is used by comm_hook='powersgd'"),
    (dict(layout="dp=2", sequence_parallel=True),
     r"sequence_parallel is a tensor-parallel setting, but the layout dp=2 has no tp axis"),
    (dict(layout="pp=2", sequence_parallel=True), r"sequence_parallel .* layout pp=2 has no tp"),
    (dict(layout="dp=2", loss_parallel=True), r"loss_parallel is a tensor-parallel setting"),
    (dict(layout="zero3=2", tp_plan={}), r"tp_plan is a tensor-parallel setting"),
])
def test_a_setting_that_does_nothing_under_the_layout_is_an_error(world_of_two, tmp_path,
                                                                  overrides, match):
    with pytest.raises(ConfigError, match=match):
        Trainer(**_kwargs(tmp_path, **overrides))


def test_ddp_settings_on_one_process_are_an_error_too(tmp_path):
    with pytest.raises(ConfigError, match=r"layout single does not use DDP \(no data-parallel"):
        Trainer(**_kwargs(tmp_path, comm_hook="fp16"))
    Trainer(**_kwargs(tmp_path, layout="dp=1"))  # the defaults are fine everywhere


def test_pipeline_options_without_a_pipeline(tmp_path):
    with pytest.raises(ConfigError, match="need a pipeline layout"):
        Trainer(**_kwargs(tmp_path, stages_per_rank=2))


# ---- fault tolerance settings -------------------------------------------------------------------
@pytest.mark.parametrize("overrides, match", [
    (dict(nan_policy="ignore"), "nan_policy must be one of"),
    (dict(nan_policy="rollback"), "needs periodic checkpoints"),
    (dict(stall_timeout_s=300, collective_timeout_s=300), "must be below collective_timeout_s"),
    (dict(stall_timeout_s=-1), "stall_timeout_s must be a positive number"),
    (dict(collective_timeout_s=0), "collective_timeout_s must be a positive"),
    (dict(checkpoint_every_n_steps=0), "checkpoint_every_n_steps must be a positive"),
    (dict(checkpoint_every_n_minutes=-2.0), "checkpoint_every_n_minutes must be a number > 0"),
    (dict(keep_last_k=0), "keep_last_k must be a positive"),
    (dict(resume=42), "resume must be 'auto', None or a checkpoint folder"),
])
def test_bad_fault_tolerance_settings(world_of_two, tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        Trainer(**_kwargs(tmp_path, **overrides))


def test_resume_from_a_missing_or_incomplete_checkpoint(world_of_two, tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        Trainer(**_kwargs(tmp_path, resume=tmp_path / "nowhere"))
    partial = tmp_path / "checkpoints" / "step_00000004"
    partial.mkdir(parents=True)  # e.g. a save that was interrupted
    with pytest.raises(ConfigError, match="not a complete meshtrain checkpoint"):
        Trainer(**_kwargs(tmp_path, resume=partial))


def test_async_checkpoint_must_be_a_bool(world_of_two, tmp_path):
    with pytest.raises(ConfigError, match="async_checkpoint must be True or False"):
        Trainer(**_kwargs(tmp_path, async_checkpoint="yes"))


# -- the model/loss boundary: torch's message stays, meshtrain says what it fed and expected ----
def test_a_per_sample_loss_is_refused_naming_the_shape(tmp_path):
    per_sample = lambda out, y: ((out - y) ** 2).mean(dim=1)  # noqa: E731
    with pytest.raises(ConfigError, match=r"loss_fn returned tensor \(8,\) float32, but meshtrain "
                                          r"needs one number per micro-batch"):
        Trainer(**_kwargs(tmp_path)).fit(_model, _data(), optimizer=_sgd, loss_fn=per_sample)


def test_no_loss_fn_with_a_model_that_returns_predictions(tmp_path):
    with pytest.raises(TypeError, match="positional argument") as caught:
        Trainer(**_kwargs(tmp_path)).fit(_model, _data(), optimizer=_sgd)
    (note,) = caught.value.__notes__
    assert "without loss_fn meshtrain calls the model with the whole batch (tensor (8, 4) " \
           "float32, tensor (8, 2) float32)" in note and "pass loss_fn=" in note


def test_samples_of_the_wrong_width(tmp_path):
    wide = TensorDataset(torch.randn(32, 5), torch.randn(32, 2))
    with pytest.raises(RuntimeError, match="mat1 and mat2") as caught:
        Trainer(**_kwargs(tmp_path)).fit(_model, wide, optimizer=_sgd,
                                         loss_fn=torch.nn.functional.mse_loss)
    assert "model(inputs) with inputs tensor (8, 5) float32" in caught.value.__notes__[0]


def test_a_dataparallel_model_is_refused_with_the_process_per_device_advice(tmp_path):
    _fit_raises(_kwargs(tmp_path), r"torch.nn.DataParallel.*model.module.*devices=N",
                model=torch.nn.DataParallel(_model()))
