"""zero1 (DDP + ZeroRedundancyOptimizer) reproduces one process, halves the optimizer state per
rank, and checkpoints through DCP in get_state_dict's format, loadable on any world size."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from conftest import end_together, join_gloo, max_diff
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from meshtrain.errors import ConfigError
from meshtrain.launch.spawn import run_workers
from meshtrain.parallel.data.zero1 import (
    load_zero1_state_dict,
    make_zero1_optimizer,
    optimizer_spec,
    zero1_state_dict,
    zero1_state_dict_template,
)

STEPS, BATCH, IN, OUT = 10, 16, 16, 3

pytestmark = pytest.mark.usefixtures("one_thread_per_module")


def mlp(seed: int = 0) -> torch.nn.Module:
    # Sizes chosen so the greedy owner assignment splits the state about evenly on 2 ranks.
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 16), torch.nn.GELU(), torch.nn.Linear(16, OUT))


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def batches():
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(STEPS, BATCH, IN, generator=gen)
    return x, torch.randn(STEPS, BATCH, OUT, generator=gen)


def train(model, optimizer, steps, rank=0, world=1):
    """Steps ``steps`` of the fixed data; each rank takes its slice of every global batch."""
    xs, ys = batches()
    part = BATCH // world
    for step in steps:
        x, y = xs[step, rank * part:(rank + 1) * part], ys[step, rank * part:(rank + 1) * part]
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def flat_state(state: dict) -> dict:
    """{"fqn.name": tensor} of an optimizer state dict's ``state``."""
    return {f"{fqn}.{k}": torch.as_tensor(v).clone()
            for fqn, entry in state.items() for k, v in entry.items()}


def zero1(model, reverse=False, lr=1e-2, group=None):
    ps = list(model.parameters())
    factory = lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.1)  # noqa: E731
    return make_zero1_optimizer(ps[::-1] if reverse else ps, factory, group)


def owners(model, optimizer):
    return sorted(zero1_state_dict(model, optimizer)["state"])


def load(path, model, optimizer, group=None):
    """Fresh model and zero1 optimizer <- checkpoint at ``path``, as the lead's loader would."""
    state = {"model": get_model_state_dict(model),
             "optim": zero1_state_dict_template(model, optimizer)}
    dcp.load(state, checkpoint_id=path, process_group=group)
    model.load_state_dict(state["model"])
    load_zero1_state_dict(model, optimizer, state["optim"])


# -- parity and memory ----------------------------------------------------------------------------
def _zero1_rank():
    rank, world = join_gloo()
    model = mlp()
    optimizer = zero1(model)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    train(ddp, optimizer, range(STEPS), rank, world)
    state_bytes = sum(t.nbytes for e in optimizer.optim.state.values() for t in e.values())
    return end_together((params(model), state_bytes))


@pytest.fixture(scope="module")
def zero1_run():
    return run_workers(_zero1_rank, 2, timeout=110)


@pytest.fixture(scope="module")
def reference():
    model = mlp()
    optimizer = adamw(model.parameters())
    train(model, optimizer, range(STEPS))
    state_bytes = sum(t.nbytes for e in optimizer.state.values() for t in e.values())
    return params(model), state_bytes


@pytest.mark.timeout(120)
def test_zero1_matches_one_process(zero1_run, reference):
    ref_params, _ = reference
    assert max_diff(ref_params, params(mlp())) > 1e-2, "training barely moved the parameters"
    for rank_params, _ in zero1_run:
        assert max_diff(ref_params, rank_params) <= 1e-5


@pytest.mark.timeout(120)
def test_zero1_shards_optimizer_state(zero1_run, reference):
    _, full_bytes = reference
    per_rank = [state_bytes for _, state_bytes in zero1_run]
    assert sum(per_rank) == full_bytes
    assert all(0.4 * full_bytes <= b <= 0.6 * full_bytes for b in per_rank), (per_rank, full_bytes)


# -- checkpoints -----------------------------------------------------------------------------------
def _save_and_reload_rank(zero_dir, plain_dir):
    rank, world = join_gloo()
    # Save under zero1 after 3 steps; remember this rank's part and the next step's result.
    model = mlp()
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    optimizer = zero1(model)
    train(ddp, optimizer, range(3), rank, world)
    saved = zero1_state_dict(model, optimizer)
    dcp.save({"model": get_model_state_dict(model), "optim": saved}, checkpoint_id=zero_dir)
    saved_flat = flat_state(saved["state"])
    train(ddp, optimizer, [3], rank, world)
    after = params(model)

    # Load into a fresh, never-stepped zero1 whose owners differ (parameters in reverse order).
    fresh = mlp(seed=1)
    fresh_ddp = DistributedDataParallel(fresh, gradient_as_bucket_view=True)
    fresh_opt = zero1(fresh, reverse=True, lr=0.5)  # options come from the checkpoint
    zero1_state_dict_template(fresh, fresh_opt)
    untouched = len(fresh_opt.optim.state) == 0 and all(p.grad is None for p in fresh.parameters())
    load(zero_dir, fresh, fresh_opt)
    loaded_flat = flat_state(zero1_state_dict(fresh, fresh_opt)["state"])
    lr = (fresh_opt.param_groups[0]["lr"], fresh_opt.optim.param_groups[0]["lr"])
    train(fresh_ddp, fresh_opt, [3], rank, world)

    # A plain AdamW checkpoint (world size 1, get_state_dict) into zero1 on 2 ranks.
    other = mlp(seed=2)
    other_opt = zero1(other)
    load(plain_dir, other, other_opt)
    from_plain = flat_state(zero1_state_dict(other, other_opt)["state"])
    result = dict(saved=saved_flat, groups=saved["param_groups"], after=after,
                  owners=owners(model, optimizer), fresh_owners=owners(fresh, fresh_opt),
                  untouched=untouched, loaded=loaded_flat, lr=lr, resumed=params(fresh),
                  from_plain=from_plain)

    # World size 1: rank 0 alone, in a group of its own, loads the 2-rank checkpoint.
    solo = dist.new_group([0])
    if rank == 0:
        alone = mlp(seed=1)
        alone_opt = zero1(alone, group=solo)
        load(zero_dir, alone, alone_opt, group=solo)
        result["solo_loaded"] = flat_state(zero1_state_dict(alone, alone_opt)["state"])
        train(alone, alone_opt, [3])
        result["solo_resumed"] = params(alone)
        with pytest.raises(ConfigError, match="no optimizer state for"):
            load_zero1_state_dict(alone, alone_opt, {"state": {}, "param_groups": []})
        # Before the first step: what get_state_dict would write (its zero-lr step's state).
        fresh, plain = mlp(), mlp()
        fresh_opt, plain_opt = zero1(fresh, group=solo), adamw(plain.parameters())
        result["solo_fresh"] = flat_state(zero1_state_dict(fresh, fresh_opt)["state"])
        result["solo_fresh_live"] = len(fresh_opt.optim.state)
        result["plain_fresh"] = flat_state(get_state_dict(plain, plain_opt)[1]["state"])
    return end_together(result)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero1_ckpt")
    model = mlp(seed=3)
    optimizer = adamw(model.parameters())
    train(model, optimizer, range(2))
    msd, osd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=root / "plain")
    plain = flat_state(osd["state"])
    runs = run_workers(_save_and_reload_rank, 2, (root / "zero1", root / "plain"), timeout=110)
    return root, (plain, osd["param_groups"]), runs


@pytest.mark.timeout(120)
def test_zero1_checkpoint_writes_each_entry_once(checkpoints):
    root, (plain, plain_groups), runs = checkpoints
    assert not runs[0]["saved"].keys() & runs[1]["saved"].keys()
    full = {**runs[0]["saved"], **runs[1]["saved"]}
    # get_state_dict's format: "0.weight" -> step, exp_avg, exp_avg_sq; groups list all FQNs.
    assert full.keys() == plain.keys()
    assert runs[0]["groups"] == runs[1]["groups"] == plain_groups
    metadata = dcp.FileSystemReader(root / "zero1").read_metadata()
    files = {}
    for index, info in metadata.storage_data.items():
        if index.fqn.startswith("optim.state."):
            files.setdefault(index.fqn, []).append(info.relative_path)
    assert sorted(files) == sorted(f"optim.state.{k}" for k in full)
    assert all(len(paths) == 1 for paths in files.values())
    assert len({paths[0] for paths in files.values()}) == 2  # both ranks wrote their own part


@pytest.mark.timeout(120)
def test_zero1_checkpoint_loads_on_two_ranks_with_other_owners(checkpoints):
    _, _, runs = checkpoints
    full = {**runs[0]["saved"], **runs[1]["saved"]}
    assert runs[0]["owners"] != runs[0]["fresh_owners"]
    for run in runs:
        assert run["untouched"], "the template must not create state in the live optimizer"
        owned = {k for k in full if any(k.startswith(f"{fqn}.") for fqn in run["fresh_owners"])}
        assert run["loaded"].keys() == owned
        assert max_diff(run["loaded"], {k: full[k] for k in run["loaded"]}) == 0
        assert run["lr"] == (1e-2, 1e-2)
        assert max_diff(run["resumed"], run["after"]) <= 1e-7


@pytest.mark.timeout(120)
def test_zero1_checkpoint_loads_on_one_rank_and_into_plain_adamw(checkpoints):
    root, _, runs = checkpoints
    full = {**runs[0]["saved"], **runs[1]["saved"]}
    assert max_diff(runs[0]["solo_loaded"], full) == 0
    assert max_diff(runs[0]["solo_resumed"], runs[0]["after"]) <= 1e-6
    assert max_diff(runs[0]["solo_fresh"], runs[0]["plain_fresh"]) == 0
    assert runs[0]["solo_fresh_live"] == 0  # and, unlike get_state_dict, left the optimizer alone
    # The same checkpoint through torch's own get_state_dict/set_state_dict, no process group.
    model = mlp(seed=1)
    optimizer = adamw(model.parameters())
    msd, osd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=root / "zero1")
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
    assert max_diff(flat_state(get_state_dict(model, optimizer)[1]["state"]), full) == 0


@pytest.mark.timeout(120)
def test_plain_checkpoint_loads_into_zero1_on_two_ranks(checkpoints):
    _, (plain, _), runs = checkpoints
    loaded = {**runs[0]["from_plain"], **runs[1]["from_plain"]}
    assert not runs[0]["from_plain"].keys() & runs[1]["from_plain"].keys()
    assert max_diff(loaded, plain) == 0


# -- user mistakes ---------------------------------------------------------------------------------
def test_optimizer_spec_recovers_class_and_options():
    cls, options, groups = optimizer_spec(adamw)
    assert cls is torch.optim.AdamW and len(groups) == 1 and len(groups[0]["params"]) == 2
    assert options["lr"] == 1e-2 and options["weight_decay"] == 0.1
    assert "decoupled_weight_decay" not in options  # in AdamW's defaults, not its arguments


def no_decay_on_norms_and_biases(params):
    """What most users do: weight decay on matrices only (and a group-specific lr, to see that
    every group keeps its own options)."""
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2]},
                              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0,
                               "lr": 3e-2}], lr=1e-2, weight_decay=0.1)


def test_parameter_groups_keep_their_options():
    _, _, groups = optimizer_spec(no_decay_on_norms_and_biases, list(mlp().parameters()))
    assert [(g["weight_decay"], g["lr"], len(g["params"])) for g in groups] == [
        (0.1, 1e-2, 3), (0.0, 3e-2, 3)]


@pytest.mark.timeout(120)
def test_zero1_with_parameter_groups_matches_one_process():
    """Weight decay off for biases under zero1 (refused before: one group only)."""
    from parity import assert_parity

    assert_parity("zero1=2", 2, steps=8, fns=dict(optimizer_fn=no_decay_on_norms_and_biases))


@pytest.mark.parametrize("factory, message", [
    (lambda ps: torch.optim.SGD([p for p in ps if p.ndim == 2], lr=0.1), "kept 3 of the 6"),
    (lambda ps: None, "returned NoneType"),
    (lambda ps: torch.optim.AdamW(ps, lr="fast"), "factory failed"),
])
def test_factory_errors(factory, message):
    with pytest.raises(ConfigError, match=message):
        make_zero1_optimizer(mlp().parameters(), factory)


def test_parameter_errors():
    with pytest.raises(ConfigError, match="no parameters"):
        make_zero1_optimizer([], adamw)
    with pytest.raises(ConfigError, match="group them inside it"):
        make_zero1_optimizer([{"params": list(mlp().parameters())}], adamw)
    with pytest.raises(ConfigError, match="ZeroRedundancyOptimizer"):
        zero1_state_dict(mlp(), adamw(mlp().parameters()))
