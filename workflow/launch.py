"""How the training rules start their processes: one home for the torchrun command line and for the Slurm
allocation of a training job (tests/workflow/test_slurm.py tests both).

* One node (the default, `snakemake --cores N`, `dvc repro`, or one Slurm node): `torchrun --standalone`,
  a private rendezvous on a free local port, exactly the command the pipeline always ran (dvc.yaml's cmd
  and the recorded outputs do not change).
* N nodes (`slurm.nodes` > 1, inside one Slurm allocation of N nodes): `srun` starts one torchrun agent per
  node, and the agents meet at a c10d rendezvous on the allocation's first node. The batch script runs on
  that node, so it looks up the endpoint once, before srun; Slurm node names need not resolve as host
  names (NodeName vs NodeAddr), so the endpoint is the node's NodeAddr from `scontrol show node`.

Run as a script inside an allocation, `python workflow/launch.py rdzv-endpoint --port P` prints HOST:PORT, PORT
= P + (the job id mod 1000): each job its own rendezvous store, so concurrent jobs sharing a first node never meet.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys


def torchrun_launch(nproc_per_node: int, nodes: int = 1, rdzv_port: int = 29500) -> str:
    """The command prefix that starts `nodes` x `nproc_per_node` training processes; the caller appends
    `-m stages.<stage> -- <stage args>`. For several nodes it is a shell fragment (it sets `endpoint` in
    the job's shell and runs srun), meant for a rule's `shell:` inside a Slurm allocation of `nodes` nodes."""
    for name, value in (("nproc_per_node", nproc_per_node), ("nodes", nodes), ("rdzv_port", rdzv_port)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"launch: {name} must be a positive integer, got {value!r}")
    if nodes == 1:
        return f"torchrun --standalone --nproc-per-node {nproc_per_node}"
    # `endpoint=$(...) &&`: a failed lookup stops the command (DVC runs cmds without `set -e`).
    # srun: one task (one torchrun agent) per node; --kill-on-bad-exit ends the others when one fails
    # (`=`: its value is optional, so a bare `1` would be read as the command).
    # --rdzv-id: the job id, so two jobs sharing a first node never join each other's rendezvous.
    return (f"endpoint=$(python workflow/launch.py rdzv-endpoint --port {rdzv_port}) &&"
            f" srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1"
            f" torchrun --nnodes {nodes} --nproc-per-node {nproc_per_node}"
            f' --rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "$SLURM_JOB_ID"')


def train_resources(gpus: int, nproc_per_node: int, cpu_threads: int, slurm: dict) -> dict:
    """Snakemake resources of a training rule: its Slurm allocation (read by snakemake-executor-plugin-slurm;
    a local run reads only `gpu` and `nproc`). One node: an ordinary job (the plugin wraps it in `srun -n1`).
    Several nodes: the plugin's `mpi` mode (it then leaves the srun to the rule's command: torchrun_launch)
    with one task per node; GPUs as `gres` (per node in Slurm), CPUs per task for all processes of a node."""
    nodes = slurm["nodes"]
    res = {
        "gpu": gpus,
        "nproc": nproc_per_node,
        # A torchrun agent per node runs nproc_per_node workers of cpu_threads intra-op threads each.
        "cpus_per_task": max(1, nproc_per_node * cpu_threads) if gpus == 0
        else max(1, gpus * slurm["cpus_per_gpu"]),
        "mem_mb": slurm["train_mem_mb"],
        "runtime": slurm["train_runtime_min"],
    }
    if nodes > 1:
        res.update({"nodes": nodes, "tasks": nodes, "mpi": "srun",
                    # the plugin derives --ntasks-per-gpu from `tasks` on GPU jobs unless this is set to 0
                    "tasks_per_gpu": 0})
        if gpus > 0:
            # `gpu` would ask for that many GPUs in the whole job (--gpus); gres is per node.
            res["gres"] = f"gpu:{gpus}"
            del res["gpu"]
    return res


def first_hostname(hostnames_output: str) -> str:
    """The first node of `scontrol show hostnames $SLURM_JOB_NODELIST` (Slurm's node order: the batch host)."""
    names = hostnames_output.split()
    if not names:
        raise ValueError("launch: refused: `scontrol show hostnames` listed no node (is SLURM_JOB_NODELIST set?)")
    return names[0]


def node_address(show_node_output: str, name: str) -> str:
    """NodeAddr of `scontrol show node NAME`: where the node is reached (NodeName is only a label when a
    site, or a test, runs several slurmd per host)."""
    m = re.search(r"\bNodeAddr=(\S+)", show_node_output)
    if not m:
        raise ValueError(f"launch: refused: `scontrol show node {name}` gave no NodeAddr")
    return m.group(1)


def job_nodelist(show_job_output: str, job_id: str) -> str:
    """NodeList of `scontrol show job ID` (not ReqNodeList/ExcNodeList)."""
    m = re.search(r"(?<![A-Za-z])NodeList=(\S+)", show_job_output)
    if not m or m.group(1) == "(null)":
        raise ValueError(f"launch: refused: `scontrol show job {job_id}` gave no NodeList (job not running?)")
    return m.group(1)


# A multi-node job's rendezvous port: slurm.rdzv_port + (job id mod RDZV_PORT_SPAN). With one fixed port, two
# 2-node jobs sharing a first node (ref_logps and train_rm both start after sft) met at one address: the second
# agent, unable to bind, became a client of the first job's TCP store (torch falls back to client mode), so its
# rendezvous and its workers' process group lived in another job's store, which vanished when that job ended.
RDZV_PORT_SPAN = 1000


def rdzv_port_for_job(base: int, job_id: str) -> int:
    """The job's own rendezvous port: consecutive job ids (the jobs a run submits together) get distinct ports;
    ids 1000 apart share one, long after the earlier job ended on any cluster that runs jobs by the thousand."""
    if not job_id.isdigit():
        raise ValueError(f"launch: refused: SLURM_JOB_ID {job_id!r} is not a job number")
    return base + int(job_id) % RDZV_PORT_SPAN


def rdzv_endpoint(port: int) -> str:
    """HOST:PORT of the allocation's first node, PORT = rdzv_port_for_job(port, SLURM_JOB_ID) (the base itself
    outside a job, where no id exists: a test's or a user's manual lookup)."""
    def run(*cmd: str) -> str:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise ValueError(f"launch: refused: `{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")
        return r.stdout
    # Snakemake's jobstep plugin passes a job's command only SLURM_JOB_ID (it drops the other SLURM_*
    # variables before its inner srun), so the node list is asked of the controller when it is not set.
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if not nodelist and job_id:
        nodelist = job_nodelist(run("scontrol", "show", "job", job_id), job_id)
    if not nodelist:
        raise ValueError("launch: refused: neither SLURM_JOB_NODELIST nor SLURM_JOB_ID is set: several nodes "
                         "need a Slurm allocation")
    name = first_hostname(run("scontrol", "show", "hostnames", nodelist))
    if job_id:
        port = rdzv_port_for_job(port, job_id)
    return f"{node_address(run('scontrol', 'show', 'node', name), name)}:{port}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ep = sub.add_parser("rdzv-endpoint", help="HOST:PORT of the allocation's first node (PORT: --port + job id "
                                              f"mod {RDZV_PORT_SPAN})")
    ep.add_argument("--port", type=int, required=True, help="slurm.rdzv_port, the first port of the range")
    args = ap.parse_args(argv)
    try:
        print(rdzv_endpoint(args.port))
    except (ValueError, FileNotFoundError) as exc:
        # One line naming the cause (scontrol's own message when it failed); the job's command then stops.
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
