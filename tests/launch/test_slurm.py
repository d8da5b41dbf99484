"""`meshtrain slurm`: the sbatch script it writes, run under fake Slurm commands, and --submit."""

import os
import re
import stat
import subprocess

import pytest

from meshtrain.errors import ConfigError
from meshtrain.launch.slurm import render_sbatch, slurm

USER_ARGS = ["--name", "my run", "it's", "$HOME", "a;b"]


def _render(**overrides):
    options = dict(
        script="train.py",
        script_args=USER_ARGS,
        nodes=4,
        gpus_per_node=8,
        cpus_per_task=32,
        job_name="big",
        time="04:00:00",
        partition="gpu",
        account="proj",
        output="logs/%j.out",
        port=29511,
    )
    options.update(overrides)
    return render_sbatch(**options)


def _executable(path, text):
    path.write_text("#!/bin/bash\n" + text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_sbatch_lines():
    lines = _render().splitlines()
    assert lines[0] == "#!/bin/bash"
    sbatch = [line for line in lines if line.startswith("#SBATCH")]
    assert sbatch == [
        "#SBATCH --job-name=big",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --time=04:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj",
        "#SBATCH --output=logs/%j.out",
    ]
    assert "set -euo pipefail" in lines
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"' in lines  # 32 CPUs / 8 workers


def test_optional_lines_are_left_out():
    text = render_sbatch(script="t.py", nodes=1, gpus_per_node=1)
    assert "--partition" not in text and "--account" not in text and "--time" not in text
    assert "--cpus-per-task" not in text
    # the CPUs the task got, shared by its one worker (nproc reads the task's affinity)
    assert ('export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) / 1 > 0 ? $(nproc) / 1 : 1 '
            '))}"') in text


def test_cpu_workers_ask_for_no_gpu_and_a_module_runs_with_m():
    text = render_sbatch(script="meshtrain", script_args=["train", "job.toml"], nodes=2,
                         nproc_per_node=3, module=True, cpus_per_task=6)
    assert "gpus" not in text
    assert "#SBATCH --cpus-per-task=6" in text.splitlines()
    assert 'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"' in text  # 6 CPUs / 3 workers
    assert "    --nproc-per-node 3 \\" in text.splitlines()
    assert text.rstrip().endswith("    -m meshtrain train job.toml")


def test_requeue_before_asks_for_the_signal_a_requeue_and_one_log():
    lines = render_sbatch(script="t.py", nodes=1, gpus_per_node=1, time="01:00:00",
                          requeue_before=120).splitlines()
    assert ["#SBATCH --signal=USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"] == \
        [line for line in lines if re.match("#SBATCH --(signal|requeue|open-mode)", line)]
    assert "--signal" not in render_sbatch(script="t.py", nodes=1, gpus_per_node=1)


def test_bash_accepts_the_syntax(tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(_render())
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=10)


@pytest.mark.timeout(30)
def test_script_runs_torchrun_at_the_head_node_under_fake_slurm(tmp_path):
    """Run the script with stand-ins for scontrol/srun and read back the exact argv srun got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(
        bin_dir / "scontrol", 'test "$*" = "show hostnames n[1-2]" && printf "n1\\nn2\\n"\n'
    )
    _executable(  # getent as on a host whose name maps to 127.0.1.1 in /etc/hosts
        bin_dir / "srun",
        'if [ "${*: -2:1}" = "ahostsv4" ]; then\n'
        '  printf "%s\\n" "$@" > "$OUT/ip_call"\n'
        '  printf "127.0.1.1 STREAM n1\\n127.0.1.1 DGRAM\\n10.1.2.3 STREAM n1\\n'
        '10.1.2.3 DGRAM\\n10.9.9.9 STREAM\\n"\n'
        'else printf "%s\\n" "$@" > "$OUT/launch"; fi\n',
    )
    script = tmp_path / "job.sbatch"
    script.write_text(_render())
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        OUT=str(tmp_path),
        SLURM_JOB_NODELIST="n[1-2]",
        SLURM_NNODES="2",
        SLURM_JOB_ID="777",
    )
    env.pop("OMP_NUM_THREADS", None)
    subprocess.run(["bash", str(script)], env=env, check=True, timeout=20)

    ip_call = (tmp_path / "ip_call").read_text().splitlines()
    assert ip_call == ["--nodes=1", "--ntasks=1", "-w", "n1", "getent", "ahostsv4", "n1"]
    launch = (tmp_path / "launch").read_text().splitlines()
    assert launch == [
        "--kill-on-bad-exit=1", "--cpus-per-task=32",
        "python", "-P", "-m", "meshtrain", "run",
        "--nnodes", "2",
        "--nproc-per-node", "8",
        "--rdzv-id", "777",
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "10.1.2.3:29511",  # the first address that is not loopback
        "train.py", *USER_ARGS,
    ]  # fmt: skip


def _fake_slurm(tmp_path, addresses: str):
    """scontrol and srun stand-ins: the node list n[1-2], getent printing ``addresses``, the
    launch's argv written to OUT/launch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    _executable(bin_dir / "scontrol", 'printf "n1\\nn2\\n"\n')
    _executable(bin_dir / "srun", 'if [ "${*: -2:1}" = "ahostsv4" ]; then printf "%b" '
                f"'{addresses}'; [ -n '{addresses}' ] || exit 2\n"
                'else printf "%s\\n" "$@" > "$OUT/launch"; fi\n')
    return bin_dir


def _run_script(tmp_path, text: str, job_id: str, nodes: str) -> subprocess.CompletedProcess:
    script = tmp_path / f"job{job_id}.sbatch"
    script.write_text(text)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", OUT=str(tmp_path),
               SLURM_JOB_NODELIST="n[1-2]", SLURM_NNODES=nodes, SLURM_JOB_ID=job_id)
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                          timeout=20)


@pytest.mark.timeout(30)
def test_two_jobs_get_different_ports_derived_from_their_ids(tmp_path):
    """Without --port the port is 20000 + job id % 10000 (below the ephemeral ports): two jobs
    that share a node do not collide (tests/launch/test_slurm_cluster.py runs two at once)."""
    _fake_slurm(tmp_path, "10.1.2.3 STREAM n1\\n")
    text = render_sbatch(script="t.py", nodes=2, nproc_per_node=1)
    endpoints = []
    for job_id in ("41234", "41235"):
        assert _run_script(tmp_path, text, job_id, "2").returncode == 0
        launch = (tmp_path / "launch").read_text().splitlines()
        endpoints.append(launch[launch.index("--rdzv-endpoint") + 1])
    assert endpoints == ["10.1.2.3:21234", "10.1.2.3:21235"]


@pytest.mark.timeout(30)
def test_a_head_node_known_only_by_loopback_is_refused_on_several_nodes(tmp_path):
    _fake_slurm(tmp_path, "127.0.1.1 STREAM n1\\n")
    text = render_sbatch(script="t.py", nodes=2, nproc_per_node=1, port=29511)
    done = _run_script(tmp_path, text, "7", "2")
    assert done.returncode == 1 and not (tmp_path / "launch").exists()
    assert "n1 resolves to no address but loopback ones on itself" in done.stderr
    # one node: loopback is enough
    assert _run_script(tmp_path, text, "7", "1").returncode == 0
    launch = (tmp_path / "launch").read_text().splitlines()
    assert launch[launch.index("--rdzv-endpoint") + 1] == "127.0.0.1:29511"


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(nodes=0), "--nodes"),
        (dict(gpus_per_node=0), "--gpus-per-node"),
        (dict(gpus_per_node=None), "give one of --gpus-per-node G .* and --nproc-per-node N"),
        (dict(nproc_per_node=2), "give one of --gpus-per-node G .* and --nproc-per-node N"),
        (dict(gpus_per_node=None, nproc_per_node=0), "--nproc-per-node is 0"),
        (dict(time="4 hours"), "--time"),
        (dict(job_name="my job"), "--job-name"),
        (dict(port=70000), "--port"),
        (dict(requeue_before=0), "--requeue-before is 0"),
    ],
)
def test_bad_options_are_refused(bad, match):
    with pytest.raises(ConfigError, match=match):
        _render(**bad)


def test_cli_writes_job_name_file_and_prints_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert slurm(["--nodes", "2", "--gpus-per-node", "4", "--job-name", "exp1", "train.py",
                  "--lr", "0.1"]) == 0  # fmt: skip
    assert capsys.readouterr().out.strip() == "exp1.sbatch"
    text = (tmp_path / "exp1.sbatch").read_text()
    assert f"#SBATCH --chdir={tmp_path}" in text
    assert text.rstrip().endswith("train.py --lr 0.1")


def test_submit_without_sbatch_raises_and_keeps_the_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    (tmp_path / "train.py").write_text("")
    out = tmp_path / "job.sbatch"
    written = f"sbatch was not found.*written to {re.escape(str(out))}"
    with pytest.raises(ConfigError, match=written):
        slurm(["--nodes", "1", "--gpus-per-node", "1", "--submit", "--sbatch-out", str(out),
               "train.py"])  # fmt: skip
    assert "#SBATCH --nodes=1" in out.read_text()


def test_submit_hands_the_file_to_sbatch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _executable(tmp_path / "sbatch", 'echo "$@" > "$(dirname "$0")/submitted"\n')
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    (tmp_path / "train.py").write_text("")
    assert slurm(["--nodes", "1", "--gpus-per-node", "1", "--submit", "train.py"]) == 0
    assert (tmp_path / "submitted").read_text().strip() == "meshtrain.sbatch"


def test_missing_script_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="'gone.py' does not exist"):
        slurm(["--nodes", "1", "--gpus-per-node", "1", "gone.py"])
