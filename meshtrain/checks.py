"""Checks on the Trainer's inputs that need no process group (models, factories, data)."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from meshtrain.errors import ConfigError
from meshtrain.settings.lightning import from_lightning  # (light: no torch)


def resolve_accelerator(accelerator: str) -> str:
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator not in ("cpu", "cuda", "gpu"):
        raise ConfigError(f"accelerator must be 'cpu', 'cuda' ('gpu') or 'auto', got "
                          f"{accelerator!r}")
    if accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise ConfigError(f"accelerator={accelerator!r} but no GPU is visible; use 'cpu' or "
                          "'auto'")
    return "cuda" if accelerator == "gpu" else accelerator


def resolve_device_type(settings: dict) -> str:
    """"cpu" or "cuda" from ``accelerator``, with the precision, float8 and offload that need
    one."""
    from meshtrain.parallel.data.fully_shard import check_offload
    from meshtrain.precision import check_precision

    device_type = resolve_accelerator(settings["accelerator"])
    check_precision(settings["precision"], device_type)
    if settings["float8"] is not None:  # float8 matmuls on this hardware (or emulated)
        from meshtrain.parallel.float8 import check_float8

        check_float8(settings["float8"], settings["float8_emulate"], device_type,
                     settings["precision"])
    if settings["offload"] is not None:
        check_offload(settings["offload"], device_type)
    if settings["compile"]:
        from meshtrain.parallel.compile import check_toolchain

        check_toolchain(device_type)
    return device_type


def check_stop(settings: dict) -> None:
    if settings["max_steps"] is None and settings["max_epochs"] is None:
        raise ConfigError("set max_steps or max_epochs (or both) so training knows when to stop")


def trainer_settings(keywords: dict) -> tuple[dict, frozenset, list[str]]:
    """(every setting's value, the names the user set, the lines to print at start) from
    ``Trainer(**keywords)``: Lightning's names taken as meshtrain's (settings/lightning.py),
    without seed= the user's own torch.manual_seed (loop/seeding.py), each value checked, the
    default stop filled in."""
    from meshtrain.settings import check

    keywords, notes = from_lightning(keywords)
    if "seed" not in keywords:  # the user's torch.manual_seed(N) before Trainer() (seeding.py)
        from meshtrain.loop.seeding import seed_from_torch

        seed = seed_from_torch()
        if seed:  # (0 is the default)
            keywords = dict(keywords, seed=seed)
            notes.append(f"seed: {seed}, from torch.manual_seed({seed}) before Trainer() "
                         "(Trainer(seed=N) sets another)")
    settings, stop_note = default_stop(check(keywords))
    return settings, frozenset(keywords), notes + ([stop_note] if stop_note else [])


def default_stop(settings: dict) -> tuple[dict, str]:
    """(``settings``, a line for the start): neither ``max_steps`` nor ``max_epochs`` set (a
    bare ``Trainer()``) trains one pass over the data, as Keras's ``fit`` does."""
    if settings["max_steps"] is None and settings["max_epochs"] is None:
        return dict(settings, max_epochs=1), ("stop: max_epochs=1 (neither max_steps nor "
                                              "max_epochs was set)")
    return settings, ""


def check_settings_apply(layout, settings: dict) -> None:
    """A setting that would do nothing under ``layout`` (or no way to stop) is an error, not
    silently ignored. ``settings``: the Trainer's, checked one by one already. What each
    setting needs is its definition's ``needs`` (meshtrain/settings/table.py)."""
    from meshtrain.settings import unmet_needs

    check_stop(settings)
    unmet = [message for _, _, message in unmet_needs(layout, settings)]
    if unmet:  # every one, so that one fix does not just reveal the next
        raise ConfigError("\nalso: ".join(unmet))
    from meshtrain.parallel.data.local_sgd import check_local_sgd

    check_local_sgd(layout, settings["local_sgd_every"], settings["outer_lr"],
                    settings["outer_momentum"])
    if layout.num_servers:
        from meshtrain.parallel.ps.layout import check_ps_layout

        check_ps_layout(layout, settings)


def check_model(model) -> None:
    from meshtrain.module.core import check_not_laid_out

    if not (isinstance(model, torch.nn.Module) or callable(model)):
        raise ConfigError(f"model must be a torch.nn.Module or a function that builds one, got "
                          f"{type(model).__name__}")
    check_not_laid_out(model)
    if isinstance(model, torch.nn.DataParallel):
        raise ConfigError(
            "the model is wrapped in torch.nn.DataParallel (one process driving several "
            "devices); meshtrain runs one process per device instead, which the Python GIL and "
            "the per-step scatter of inputs and replication of the model do not slow down: pass "
            "the bare module (model.module) and set devices=N, e.g. Trainer(devices=4, "
            "layout='dp=4') (docs/parameter_server.md)")


def inspect_model(model) -> torch.nn.Module | None:
    """The model itself, or a factory's model built on the meta device (no memory), for checks
    before any process starts; None if the factory cannot build on meta (it is built for real
    in the workers). A factory that fails on meta for a reason of its own (a config error, not
    the meta device's limits) is built once for real here, and refused if it fails there too:
    each worker would fail the same way after the processes started."""
    if isinstance(model, torch.nn.Module):
        return model
    try:
        with torch.device("meta"):
            built = model()
    except Exception as meta_error:  # noqa: BLE001 - judged below
        if "meta" not in str(meta_error).lower():
            _build_for_real(model)
        from meshtrain.check_skips import skipped

        skipped("the model's checks against the layout", "the factory cannot build it on the "
                f"meta device ({type(meta_error).__name__}: {str(meta_error)[:160]}); each "
                "rank checks it after start")
        return None
    from meshtrain.loop.compiled_model import refuse_compiled_factory

    refuse_compiled_factory(built)
    return built if isinstance(built, torch.nn.Module) else None


def _build_for_real(factory) -> None:
    """Build ``factory``'s model on the CPU once (the global random stream untouched), only to
    see whether the error on meta was the factory's own; the model is dropped."""
    try:
        with torch.random.fork_rng(devices=[]):
            factory()
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise ConfigError(
            f"the model factory failed before any process started: {type(error).__name__}: "
            f"{error}; every rank would fail the same way. Fix the model's config or factory "
            "(call it once in Python to see the full traceback)") from error


def check_factory(name: str, factory, required: bool) -> None:
    if factory is None and not required:
        return
    if isinstance(factory, torch.optim.Optimizer):
        raise ConfigError(
            f"{name} must be a factory, not an optimizer instance: the Trainer creates it after "
            f"placing the model; write {name}=lambda params: torch.optim.AdamW(params, lr=1e-3)")
    if not callable(factory):
        raise ConfigError(f"{name} must be callable, got {type(factory).__name__}")


def check_optimizer_factory(factory) -> None:
    """Call the factory on a throw-away parameter so a broken one fails before any process."""
    probe = [torch.nn.Parameter(torch.zeros(1))]
    if getattr(factory, "takes_names", False):  # meshtrain.optim: (name, parameter) pairs
        probe = [("probe", probe[0])]
    try:
        made = factory(probe)
    except Exception as error:  # noqa: BLE001 - re-raised with context
        raise ConfigError(f"the optimizer factory failed on a test parameter: {error!r}") from error
    check_optimizer(made)


def check_optimizer(made) -> None:
    if not isinstance(made, torch.optim.Optimizer):
        raise ConfigError(
            f"the optimizer factory returned {type(made).__name__}, not a torch.optim.Optimizer; "
            "did you forget `return`? Write e.g. optimizer=lambda params: AdamW(params, lr=1e-3)")


def dataset_of(data, what: str) -> Dataset:
    """The dataset behind ``data``: map-style (indexed, with a length) or a stream."""
    dataset = data.dataset if isinstance(data, DataLoader) else data
    if isinstance(dataset, IterableDataset):  # read in one global order (data/stream.py)
        return dataset
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(f"{what} must be a torch Dataset or DataLoader, got "
                          f"{type(data).__name__}")
    if len(dataset) == 0:
        raise ConfigError(f"{what} is empty")
    return dataset


def first_inputs(dataset, count: int):
    """A function giving the inputs of the first ``count`` (inputs, targets) samples, stacked
    (for measuring blocks on a sample); dict samples (``{"input_ids", "labels"}``) batched whole,
    as the loader would; None for other samples."""
    def inputs():
        batch = first_batch(dataset, count)
        return batch[0] if isinstance(batch, (tuple, list)) else batch
    return inputs


def first_batch(dataset, count: int):
    """The first ``count`` samples batched as the loader batches them ((inputs, targets) pairs
    or dicts); None for other samples."""
    from torch.utils.data import default_collate

    if isinstance(dataset, IterableDataset):
        from meshtrain.data.stream import first_items

        samples = first_items(dataset, count)
    else:
        samples = [dataset[i] for i in range(min(len(dataset), count))]
    if samples and all(isinstance(s, dict) for s in samples):
        return default_collate(samples)
    if not samples or not all(isinstance(s, (tuple, list)) and len(s) == 2 for s in samples):
        return None
    return (torch.stack([s[0] for s in samples]), default_collate([s[1] for s in samples]))


def check_pipeline_reads(dataset, original, num_workers: int) -> None:
    """Under pp every stage reads each sample itself (the first its inputs, the last its
    targets). A dataset that draws random numbers as it reads (its first sample read twice
    differs) then needs loader workers, seeded alike on every stage; in the main process the
    stages' streams part with their different dropout draws. ConfigError saying so."""
    if isinstance(original, DataLoader):
        num_workers = original.num_workers
    if num_workers or isinstance(dataset, IterableDataset):
        return
    if not _same(dataset[0], dataset[0]):
        raise ConfigError(
            f"{type(dataset).__name__}[0] gives another sample each time it is read (it draws "
            "random numbers); under pp each stage reads the sample itself, and in the main "
            "process their random streams differ, so the first stage's inputs and the last "
            "stage's targets would come from different draws. Set num_workers=1 (or more): "
            "loader workers are seeded alike on every stage")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool((a == b).all()) if hasattr(a == b, "all") else bool(a == b)
    except (TypeError, ValueError):
        return False


def is_data_factory(data) -> bool:
    """A function that builds the dataset (after ``prepare_data``), not a dataset itself."""
    return callable(data) and not isinstance(data, (Dataset, DataLoader))


def check_fit_inputs(model, train_data, val_data, *, optimizer, lr_scheduler,
                     global_batch_size: int, max_steps: int | None = None) -> Dataset | None:
    """``fit``'s arguments, before any process starts; returns the training dataset (None
    when a function builds it: :func:`check_data` checks it once built)."""
    check_model(model)
    check_factory("optimizer", optimizer, required=False)  # or the model's configure_optimizers
    check_factory("lr_scheduler", lr_scheduler, required=False)
    if optimizer is not None:
        check_optimizer_factory(optimizer)
    if val_data is not None and not is_data_factory(val_data):
        dataset_of(val_data, "val_data")
    if is_data_factory(train_data):
        return None
    return check_data(train_data, global_batch_size, max_steps)


def check_monitors(callbacks, model, val_data, settings: dict) -> None:
    """Before start: what an ``EarlyStopping`` (strict, the default) or a ``ModelCheckpoint``
    keeping the best monitors must be a value the run's validation logs
    (``meshtrain.metrics.fit_metric_names``: ``val/loss`` and ``val/<metric>``), else a typo
    (``"val/los"``) would stop the run at its first validation; the closest name is offered.
    Not checked: a run without validation data (no monitor is consulted), and a model that logs
    values of its own (``self.log``: a TrainingModule or LightningModule may add any name, so
    its monitors are checked at validation)."""
    import difflib

    from meshtrain.callbacks import EarlyStopping, ModelCheckpoint
    from meshtrain.metrics import fit_metric_names

    if val_data is None or model is None or callable(getattr(model, "log", None)):
        return
    logged = [name for name in fit_metric_names(settings) if name.startswith("val/")]
    for callback in callbacks:
        if isinstance(callback, EarlyStopping):
            consulted = callback.strict
        elif isinstance(callback, ModelCheckpoint):
            consulted = callback.monitor is not None and callback.save_top_k != 0
        else:
            continue
        if not consulted or callback.monitor in logged:
            continue
        close = difflib.get_close_matches(str(callback.monitor), logged, n=1)
        raise ConfigError(
            f"{type(callback).__name__} monitors {callback.monitor!r}, which this run's "
            f"validation does not log (it logs {', '.join(map(repr, logged))})"
            + (f"; did you mean {close[0]!r}?" if close else ";")
            + f" set monitor= to one of those ({type(callback).__name__}(monitor="
            f"{(close or logged)[0]!r}); a value of your own: self.log(...) in a "
            "TrainingModule's validation_step, or metrics=[...])")


def check_data(train_data, global_batch_size: int, max_steps: int | None) -> Dataset:
    """The training data against the global batch; returns its dataset."""
    train_set = dataset_of(train_data, "train_data")
    if isinstance(train_set, IterableDataset):
        check_stream(train_set, global_batch_size, max_steps)
    elif len(train_set) < global_batch_size:
        raise ConfigError(f"train_data has {len(train_set)} samples, fewer than one global batch "
                          f"of {global_batch_size}; lower global_batch_size or add data")
    return train_set


def check_stream(stream, global_batch_size: int, max_steps: int | None) -> None:
    """A training stream: its length is known, or max_steps bounds the run."""
    from meshtrain.data.stream import stream_length

    length = stream_length(stream)
    if length is None and max_steps is None:
        raise ConfigError(
            "train_data is a stream (an IterableDataset) without __len__, so an epoch's length "
            "is unknown; set max_steps (e.g. max_steps=1000) to say how long to train")
    if length is not None and length < global_batch_size:
        raise ConfigError(f"train_data has {length} items, fewer than one global batch of "
                          f"{global_batch_size}; lower global_batch_size or add data")


def parse_layout(spec, world_size: int, env):
    """``Layout.parse(spec, world_size)``; in an elastic job (``meshtrain run --nnodes
    MIN:MAX``, or one torchrun restarted) whose world size the layout does not fit, the error
    says so and how to let the layout follow."""
    from meshtrain.errors import LayoutError
    from meshtrain.launch.spawn import NNODES_ENV, ROUND_ENV, restart_count
    from meshtrain.parallel.layout import Layout

    try:
        return Layout.parse(spec, world_size)
    except LayoutError as error:
        low, _, high = os.environ.get(NNODES_ENV, "").partition(":")
        elastic = bool(high) and low != high
        if env is None or not (elastic or restart_count() or int(os.environ.get(ROUND_ENV) or 0)):
            raise
        raise LayoutError(
            f"{error}. This elastic job has {env.nodes} node(s) now, {world_size} process(es) "
            "in all: under --nnodes MIN:MAX the world size follows the nodes there are (after "
            "a node is lost, the ones that are left), so give one axis the degree 'auto' (e.g. "
            "dp=auto) to train on them"
        ) from None
