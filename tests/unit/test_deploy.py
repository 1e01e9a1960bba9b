"""The Kubernetes manifests (deploy/kubernetes/) and Slurm scripts (deploy/slurm/) hold together
without a cluster.

Every Kubernetes object validates, strictly, against the schemas of a pinned Kubernetes version
(kubernetes-validate ships them: nothing is downloaded). Every command that runs diloco, `diloco ...`
or `torchrun ... -m cli ...`, parses against the real CLI (and torchrun's options against torchrun's
own parser), with the `$(VAR)` references Kubernetes would expand filled in. The workers dial the
coordinator's Service, the Secrets they name exist, the learners are an Indexed Job whose worker id is
the completion index. The sbatch scripts pass `bash -n`, and run under bash with `srun`, `torchrun`
and `diloco` replaced by stubs that record their command lines, which then parse the same way.
"""

from __future__ import annotations

import copy
import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate.utils import ValidationError, all_versions, validate
from torch.distributed.run import get_args_parser

from diloco.errors import DilocoError
from diloco.security.transport import TOKEN_FILE_ENV, read_token
from tests.support import REPO, UsageError, parse_diloco

K8S = REPO / "deploy" / "kubernetes"
SLURM = REPO / "deploy" / "slurm"
# The newest Kubernetes that kubernetes-validate 1.37 (the dev extra's lower bound) has schemas for.
KUBERNETES_VERSION = "1.37.0"
IMAGE_ENTRYPOINT = ["diloco"]  # docker/Dockerfile's ENTRYPOINT: what a container without `command` runs


def k8s_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def k8s_objects() -> list[tuple[str, dict]]:
    return [(p.name, doc) for p in k8s_files() for doc in yaml.safe_load_all(p.read_text()) if doc]


def find(kind: str, name: str) -> dict:
    [obj] = [o for _, o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def pod_specs() -> dict[str, dict]:
    """Each workload's pod spec, by the workload's name."""
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"]
        for _, o in k8s_objects()
        if o["kind"] in ("StatefulSet", "Deployment", "Job")
    }


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion in command and args, from the container's env; an undeclared
    variable fails here (Kubernetes would leave `$(VAR)` in the argument as it is)."""

    def one(m: re.Match) -> str:
        assert m.group(1) in env, f"$({m.group(1)}) is not in the container's env"
        return env[m.group(1)]

    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def plausible_env(container: dict, completion_index: int = 0) -> dict[str, str]:
    """What the container's env holds at run time: literal values as written, the completion index
    from its annotation, anything from a Secret a placeholder."""
    env = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "job-completion-index" in var["valueFrom"].get("fieldRef", {}).get("fieldPath", ""):
            env[var["name"]] = str(completion_index)
        else:
            env[var["name"]] = "from-a-secret"
    return env


def torchrun_args(argv: list[str]) -> Any:
    """torchrun's own parser on its arguments (argparse exits on a bad one)."""
    try:
        return get_args_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"`torchrun {' '.join(argv)}` does not parse (exit {e.code})")


def diloco_argv(argv: list[str]) -> list[str]:
    """`diloco ARGS` or `torchrun [its options] -m cli ARGS` -> ARGS."""
    if argv[0] == "diloco":
        return argv[1:]
    assert argv[0] == "torchrun", argv
    ns = torchrun_args(argv[1:])
    assert ns.module and ns.training_script == "cli", f"torchrun must run `-m cli`: {argv}"
    return list(ns.training_script_args)


def parsed(argv: list[str]) -> dict[str, Any]:
    try:
        return parse_diloco(diloco_argv(argv)).params
    except UsageError as e:
        pytest.fail(f"`{' '.join(argv)}`: {e}")


def container_argv(container: dict, completion_index: int = 0) -> list[str]:
    env = plausible_env(container, completion_index)
    argv = container.get("command", IMAGE_ENTRYPOINT) + container.get("args", [])
    return [expand(str(a), env) for a in argv]


def containers() -> list[tuple[str, dict]]:
    return [(name, c) for name, spec in pod_specs().items() for c in spec["containers"]]


def service_address() -> str:
    service = find("Service", "diloco-coordinator")
    [grpc] = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    return f"{service['metadata']['name']}:{grpc['port']}"


# --- Kubernetes: schemas -----------------------------------------------------------------------


def test_the_pinned_kubernetes_version_is_one_kubernetes_validate_ships() -> None:
    # validate() silently takes the newest schemas not newer than asked: make sure they are these.
    assert KUBERNETES_VERSION in all_versions()


@pytest.mark.parametrize("name, obj", k8s_objects(), ids=[f"{f}:{o['kind']}" for f, o in k8s_objects()])
def test_every_object_validates_strictly(name: str, obj: dict) -> None:
    try:
        assert validate(obj, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION.rsplit(".", 1)[0]
    except ValidationError as e:
        pytest.fail(f"{name}: {obj['kind']} {'.'.join(map(str, e.path))}: {e.message}")


def test_strict_validation_refuses_a_misspelt_or_mistyped_field() -> None:
    job = find("Job", "diloco-learners")
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["completionMod"] = misspelt["spec"].pop("completionMode")
    mistyped = copy.deepcopy(job)
    mistyped["spec"]["completions"] = "two"
    for bad in (misspelt, mistyped):
        with pytest.raises(ValidationError):
            validate(bad, KUBERNETES_VERSION, strict=True)


def test_kustomization_applies_every_manifest_but_the_secrets_and_names_the_image() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    # The Secrets' placeholders must never overwrite the real ones on `apply -k`.
    assert set(kustomization["resources"]) == {p.name for p in k8s_files()} - {"secrets.yaml"}
    images = {c["image"] for _, c in containers()}
    assert images == {i["name"] for i in kustomization["images"]}, images


# --- Kubernetes: commands against the CLI ------------------------------------------------------


def test_every_diloco_command_and_probe_parses() -> None:
    assert "ENTRYPOINT " + str(IMAGE_ENTRYPOINT).replace("'", '"') in (REPO / "docker/Dockerfile").read_text()
    seen = set()
    for workload, container in containers():
        argv = container_argv(container)
        seen.add(diloco_argv(argv)[0])
        parsed(argv)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in container.get(probe, {}):
                params = parsed(container[probe]["exec"]["command"])
                assert params["coordinator"].startswith("127.0.0.1:"), (workload, probe)
    assert seen == {"coordinator", "data", "compute"}


def test_the_coordinator_listens_where_its_service_and_probes_point() -> None:
    service = find("Service", "diloco-coordinator")
    coordinator = find("StatefulSet", "diloco-coordinator")
    spec = coordinator["spec"]
    assert service["spec"]["type"] == "ClusterIP"
    assert spec["serviceName"] == service["metadata"]["name"]
    assert spec["replicas"] == 1, "one coordinator owns the ledger"
    labels = spec["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    [container] = spec["template"]["spec"]["containers"]
    params = parsed(container_argv(container))
    assert params["host"] == "0.0.0.0", "the Service reaches the pod's IP, not its loopback"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == params["port"]
    assert ports.get("http") == params["http_port"] and ports.get("metrics") == params["metrics_port"]
    for p in service["spec"]["ports"]:
        assert p["targetPort"] in ports, p
    for probe in ("startupProbe", "readinessProbe"):
        assert parsed(container[probe]["exec"]["command"])["coordinator"] == f"127.0.0.1:{params['port']}"
    assert container["livenessProbe"]["tcpSocket"]["port"] in ("grpc", params["port"])
    # The ledger (under --workdir) lives on the StatefulSet's claim, not in the container.
    claims = {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
    mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] in claims]
    assert any(str(params["workdir"]).startswith(m.rstrip("/") + "/") for m in mounts), mounts


def test_every_worker_dials_the_coordinator_service() -> None:
    workers = [(w, c) for w, c in containers() if w != "diloco-coordinator"]
    assert {"diloco-data", "diloco-learners"} <= {w for w, _ in workers}, workers  # both roles are there
    for workload, container in workers:
        assert parsed(container_argv(container))["coordinator"] == service_address(), workload


def test_secrets_and_config_maps_they_name_exist_with_those_keys() -> None:
    objects = [o for _, o in k8s_objects()]
    secrets = {o["metadata"]["name"]: o["stringData"] for o in objects if o["kind"] == "Secret"}
    config_maps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    for workload, spec in pod_specs().items():
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for container in spec["containers"]:
            env = {v["name"]: v for v in container.get("env", [])}
            # S3 keys come from the Secret, never as a literal value in a manifest.
            for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
                ref = env[key]["valueFrom"]["secretKeyRef"]
                assert ref["key"] in secrets[ref["name"]], (workload, key)
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in config_maps, workload
            # The run's token: DILOCO_TOKEN_FILE is a file of the token Secret's volume.
            token_file = Path(env[TOKEN_FILE_ENV]["value"])
            [mount] = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == token_file.parent]
            secret = volumes[mount["name"]]["secret"]
            assert mount.get("readOnly") is True, workload
            [item] = [i for i in secret["items"] if i["path"] == token_file.name]
            assert item["key"] in secrets[secret["secretName"]], workload


def test_the_token_placeholder_is_refused_until_replaced(tmp_path: Path) -> None:
    """A forgotten edit of secrets.yaml stops every role at start with one clear line."""
    placeholder = tmp_path / "token"
    placeholder.write_text(find("Secret", "diloco-token")["stringData"]["token"])
    with pytest.raises(DilocoError, match="at least 16 characters"):
        read_token(str(placeholder))


def test_learners_are_an_indexed_job_of_torchrun_groups_named_by_their_index() -> None:
    job = find("Job", "diloco-learners")
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["parallelism"] == job["spec"]["completions"] >= 1
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure", "a crash restarts in place: the state dir survives"
    [container] = pod["containers"]
    assert "$(JOB_COMPLETION_INDEX)" in container["args"][container["args"].index("--worker-id") + 1]
    ids = set()
    for index in (0, 1):
        argv = container_argv(container, completion_index=index)
        ns = torchrun_args(argv[1:])
        assert ns.standalone and ns.nnodes in ("1", "1:1"), "one learner per pod: a single-node group"
        assert str(ns.nproc_per_node) == plausible_env(container)["NPROC_PER_NODE"]
        params = parsed(argv)
        ids.add(params["worker_id"])
        mounts = [m["mountPath"] for m in container["volumeMounts"]]
        assert any(params["state_dir"].startswith(m + "/") for m in mounts), "state on a volume"
    assert ids == {"learner-0", "learner-1"}
    # GPU requests: written, commented out (a CPU cluster applies the file as it is).
    assert "nvidia.com/gpu" not in str(container["resources"])
    assert re.search(r"^\s*# nvidia\.com/gpu: \d+$", (K8S / "learners.yaml").read_text(), re.M)


# --- Slurm ---------------------------------------------------------------------------------------

STUB = """#!/bin/bash
# Records its command line (NUL-separated) in a file of its own, then does what it must. Bash, as
# srun passes the environment whole: dash would drop the exported function learners.sbatch runs.
log=$(mktemp "$STUB_LOG/call.XXXXXX")
printf '%s\\0' "$(basename "$0")" "$@" >"$log"
"""
# srun: drop its own options (all written --name=value), run the command as the one task here.
SRUN = STUB + 'while [ $# -gt 0 ]; do case "$1" in --*) shift ;; *) break ;; esac; done\nexec "$@"\n'


def run_sbatch(script: str, tmp_path: Path, env: dict[str, str]) -> list[list[str]]:
    """Run the sbatch script with stubs; every stubbed call's argv."""
    stubs, log = tmp_path / "bin", tmp_path / "log"
    stubs.mkdir(parents=True)
    log.mkdir()
    for name, body in {
        "srun": SRUN,
        "torchrun": STUB,
        "diloco": STUB,
        "hostname": STUB + "echo node-7.hpc\n",
    }.items():
        (stubs / name).write_text(body)
        (stubs / name).chmod(stat.S_IRWXU)
    base = {"PATH": f"{stubs}:/usr/bin:/bin", "HOME": str(tmp_path), "USER": "someone", "STUB_LOG": str(log)}
    done = subprocess.run(
        ["bash", str(SLURM / script)],
        env={**base, **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return [p.read_text().split("\0")[:-1] for p in sorted(log.iterdir())]


@pytest.mark.parametrize("script", sorted(p.name for p in SLURM.glob("*.sbatch")))
def test_sbatch_scripts_are_valid_bash(script: str) -> None:
    done = subprocess.run(["bash", "-n", str(SLURM / script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_learners_sbatch_starts_one_torchrun_group_per_node(tmp_path: Path) -> None:
    text = (SLURM / "learners.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=1" in text.splitlines()
    ids = set()
    for node in (0, 1):
        slurm = {"SLURM_JOB_ID": "4242", "SLURM_NODEID": str(node), "SLURM_GPUS_ON_NODE": "8"}
        calls = run_sbatch(
            "learners.sbatch", tmp_path / str(node), {"DILOCO_COORDINATOR": "10.0.0.2:7070", **slurm}
        )
        [srun] = [c for c in calls if c[0] == "srun"]
        assert "--ntasks-per-node=1" in srun, "one torchrun per node"
        [torchrun] = [c for c in calls if c[0] == "torchrun"]
        ns = torchrun_args(torchrun[1:])
        assert (ns.nnodes, str(ns.nproc_per_node), ns.standalone) == ("1", "8", True), "one node, 8 ranks"
        params = parsed(torchrun)
        assert params["coordinator"] == "10.0.0.2:7070"
        ids.add(params["worker_id"])
    assert ids == {"learner-4242-0", "learner-4242-1"}, "one learner per node, named by job and node"


def test_learners_sbatch_needs_the_coordinator_and_takes_nproc(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_NODEID": "0", "NPROC": "2", "DILOCO_COORDINATOR": "c:1"}
    [torchrun] = [c for c in run_sbatch("learners.sbatch", tmp_path / "a", env) if c[0] == "torchrun"]
    assert str(torchrun_args(torchrun[1:]).nproc_per_node) == "2"
    done = subprocess.run(
        ["bash", str(SLURM / "learners.sbatch")],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode != 0 and "DILOCO_COORDINATOR" in done.stderr


def test_coordinator_sbatch_serves_and_feeds_its_data_workers(tmp_path: Path) -> None:
    env = {"DILOCO_DATASET": "s3://b/corpus/", "DILOCO_STORE": "s3://b/run1", "SLURM_NTASKS": "3"}
    calls = run_sbatch("coordinator.sbatch", tmp_path, env)
    diloco = {c[1]: parsed(c) for c in calls if c[0] == "diloco"}
    assert set(diloco) == {"coordinator", "status", "data"}
    coordinator = diloco["coordinator"]
    assert (coordinator["dataset"], coordinator["store"]) == ("s3://b/corpus/", "s3://b/run1")
    assert coordinator["host"] == "0.0.0.0"
    address = f"node-7.hpc:{coordinator['port']}"
    assert diloco["status"]["coordinator"] == diloco["data"]["coordinator"] == address
    assert (tmp_path / ".diloco" / "coordinator").read_text().strip() == address
    [data_step] = [c for c in calls if c[0] == "srun" and "data" in c]
    assert "--ntasks=2" in data_step, "every task but the coordinator's is a data worker"
    # The run's token, made once, for its owner's eyes only.
    token = tmp_path / ".diloco" / "token"
    assert len(read_token(str(token))) >= 16
    assert stat.S_IMODE(token.stat().st_mode) == 0o600


def test_coordinator_sbatch_passes_the_users_model_and_settings(tmp_path: Path) -> None:
    env = {"DILOCO_DATASET": "d/", "DILOCO_STORE": "s/", "SLURM_NTASKS": "2",
           "DILOCO_COORDINATOR_ARGS": "--model mypkg.models:tiny --set train.lr=0.001"}  # fmt: skip
    [coordinator] = [
        c for c in run_sbatch("coordinator.sbatch", tmp_path, env) if c[:2] == ["diloco", "coordinator"]
    ]
    assert coordinator[-4:] == ["--model", "mypkg.models:tiny", "--set", "train.lr=0.001"], coordinator
