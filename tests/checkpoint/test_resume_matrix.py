"""A diagonal of the resume matrix (benchmarks/resume_matrix.py runs all of it): checkpoints
saved under one layout resume under another with the same weights and optimizer state, data
position, next global batch and next-step loss as one process that never stopped.

Every layout of the matrix appears at least once (as "from" or "to"), and each cell crosses
families: one process -> interleaved pipeline, sharded -> tensor parallel, pipeline -> pipeline x
sharded (each rank saving other parameters), pipeline -> ZeRO-1, hybrid sharded -> one process,
... The checks are resume_matrix_lib.judge's."""

import pytest
from resume_matrix_lib import judge, run_matrix

from meshtrain.launch import spawn

spawn.FORKSERVER_PRELOAD.append("resume_matrix_lib")

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

CELLS = [
    ("1 process", "pp=2 interleaved"),
    ("zero3=2", "tp=2"),
    ("zero3=2", "dp_shard=2,tp=2"),
    # pipeline -> pipeline: each rank saves other parameters; before checkpoint_state listed
    # every rank's names in the optimizer's param_groups, a rank of the resumed run found none
    # of its own there and its group had no hyperparameters (KeyError: 'lr' at the next step)
    ("pp=2", "pp=2,dp_shard=2"),
    ("pp=2", "zero1=2"),
    ("dp_replicate=2,dp_shard=2", "1 process"),
    ("dp_replicate=2,dp_shard=2", "dp=2"),
]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    # one group of processes per world size: 3 to save (with the reference), 3 to resume
    return run_matrix(CELLS, tmp_path_factory.mktemp("resume_matrix"), group_by="size",
                      log=lambda message: None)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cell", CELLS, ids=[f"{f}->{t}" for f, t in CELLS])
def test_checkpoint_resumes_under_another_layout(records, cell):
    verdict = judge(records, cell)
    assert verdict.ok, f"{cell[0]} -> {cell[1]}: {verdict.status}: " + "; ".join(
        verdict.problems)
    assert verdict.loaded_diff == 0.0 and verdict.position_equal and verdict.batch_equal
