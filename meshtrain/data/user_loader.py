"""What meshtrain takes from a DataLoader given as training data: its dataset, ``collate_fn`` and
``num_workers`` always; its ``batch_size`` and order (``shuffle``) where the Trainer's own
setting was left at its default, said at start; a sampler of its own is refused.

meshtrain draws every step's samples itself (``global_batch_size`` over all ranks, one seeded
order whatever the layout: meshtrain.data.sampler), so a loader's batching is a setting to
take or to set aside, never something to run. A loader's ``batch_size`` is taken as the samples
of one step over all ranks, as one process reads them (Lightning's is per process): the same
training on one process and on N.
"""

from __future__ import annotations

from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from meshtrain.errors import ConfigError


def loader_settings(data, settings: dict, given) -> tuple[dict, list[str]]:
    """(``settings`` with what the DataLoader ``data`` says wherever ``given`` (the settings
    the user passed) has no value, the lines to print at start); unchanged for other data.
    ConfigError for a loader whose own sampler or batch sampler would be ignored."""
    if not isinstance(data, DataLoader):
        return settings, []
    name = type(data.batch_sampler).__name__ if data.batch_size is None else \
        type(data.sampler).__name__
    if data.batch_size is None:  # DataLoader(batch_sampler=...)
        raise ConfigError(_refusal(f"a batch_sampler of its own ({name})"))
    stream = isinstance(data.dataset, IterableDataset)
    random = isinstance(data.sampler, RandomSampler)
    if not stream and not (isinstance(data.sampler, SequentialSampler) or
                           (random and not data.sampler.replacement
                            and data.sampler.num_samples == len(data.dataset))):
        raise ConfigError(_refusal(f"a sampler of its own ({name})"))
    out, notes = dict(settings), []
    wants = {"global_batch_size": data.batch_size}
    if not stream:
        wants["shuffle"] = random
    taken = []
    for key, value in wants.items():
        if key not in given:
            out[key] = value
            taken.append(f"{key}={value}")
        elif settings[key] != value:
            said = f"batch_size={value}" if key == "global_batch_size" else \
                f"shuffle={value} (its sampler: {name})"
            notes.append(f"data: train_data's DataLoader {said} is not used: {key}="
                         f"{settings[key]} as set")
    if taken:
        notes.insert(0, f"data: {', '.join(taken)} from train_data's DataLoader" + (
            " (global_batch_size: the samples of one step over all ranks, as one process "
            "reads them)" if "global_batch_size" not in given else ""))
    return out, notes


def _refusal(what: str) -> str:
    return (f"train_data is a DataLoader with {what}: meshtrain draws every step's samples "
            "itself (global_batch_size over all ranks, one seeded order whatever the layout), "
            "so it would be ignored. Pass the dataset (or a DataLoader with batch_size= and "
            "shuffle=), and put any order or weighting you need into the dataset itself "
            "(e.g. torch.utils.data.Subset with the indices in your order)")
