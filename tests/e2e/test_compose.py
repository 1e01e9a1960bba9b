"""The docker compose demo (docker-compose.yml) holds together without a Docker engine.

Every diloco command in it parses as a real `diloco` invocation (an unknown or missing option fails),
the workers point at the coordinator's service name and port, the S3 endpoint and keys agree with
the object store's, the start order is right, and the corpus seed script works against a real S3
server. `docker-compose config -q` checks the file's schema where that binary is installed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

from diloco.corpus import resolve_dataset, stdlib_files
from diloco.testing.seaweed import SeaweedS3
from tests.support import UsageError, parse_diloco

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
SEED_SCRIPT = ROOT / "docker" / "seed_corpus.py"
SECRETS_SCRIPT = ROOT / "docker" / "make_secrets.py"


def make_secrets(out: Path) -> list[str]:
    """What the `secrets` service runs (the script is not a module of the package)."""
    spec = importlib.util.spec_from_file_location("make_secrets", SECRETS_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_secrets(out)


def load() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def diloco_services(spec: dict) -> dict[str, dict]:
    """The services that run the diloco image with its own entry point (`diloco`)."""
    images = {s["image"] for s in spec["services"].values() if "build" in s}
    return {
        name: s for name, s in spec["services"].items() if s.get("image") in images and "entrypoint" not in s
    }


def test_every_diloco_command_parses() -> None:
    spec = load()
    services = diloco_services(spec)
    assert {"coordinator", "data", "compute"} <= set(services)
    for name, service in services.items():
        try:
            parse_diloco(service["command"])
        except UsageError as e:
            pytest.fail(f"service {name}: `diloco {' '.join(map(str, service['command']))}`: {e}")
        test = service.get("healthcheck", {}).get("test")
        if test:
            assert test[:2] == ["CMD", "diloco"], f"service {name}: healthcheck {test}"
            try:
                parse_diloco(test[2:])
            except UsageError as e:
                pytest.fail(f"service {name}: healthcheck `{' '.join(test[1:])}`: {e}")


def test_parse_diloco_refuses_what_the_cli_refuses() -> None:
    """The check above can fail: an unknown option, a missing required one, an unknown command."""
    with pytest.raises(UsageError):
        parse_diloco(["data", "--coordinator", "c:1", "--no-such-option", "x"])
    with pytest.raises(UsageError):
        parse_diloco(["coordinator", "--port", "7070"])  # --workdir is required
    with pytest.raises(UsageError):
        parse_diloco(["learn", "--coordinator", "c:1"])
    assert parse_diloco(["compute", "--coordinator", "c:1"]).params["coordinator"] == "c:1"


def test_workers_and_healthcheck_reach_the_coordinator() -> None:
    spec = load()
    services = spec["services"]
    coord = parse_diloco(services["coordinator"]["command"]).params
    assert coord["host"] == "0.0.0.0", "the coordinator must listen beyond its own container"
    port = coord["port"]
    assert port > 0
    for name in ("data", "compute"):
        worker = parse_diloco(services[name]["command"]).params
        assert worker["coordinator"] == f"coordinator:{port}", name
        assert services[name]["depends_on"]["coordinator"]["condition"] == "service_healthy"
        assert services[name]["deploy"]["replicas"] == 2
        assert services[name]["restart"] == "on-failure", f"{name} exits 0 when done: no restart then"
    health = parse_diloco(services["coordinator"]["healthcheck"]["test"][2:]).params
    assert health["coordinator"] == f"127.0.0.1:{port}"
    published = services["coordinator"].get("ports", [])
    assert all(str(p).split(":")[-1] == str(port) for p in published), published
    # The ledger lives on a volume, under the workdir.
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["coordinator"]["volumes"]}
    assert any(str(coord["workdir"]).startswith(target + "/") for target in mounts), mounts
    assert set(mounts.values()) <= set(spec["volumes"])


def in_secrets_volume(service: dict, path: str) -> bool:
    """Whether `path` lies in the `secrets` volume as this service mounts it."""
    mounts = [v.split(":") for v in service.get("volumes", [])]
    return any(m[0] == "secrets" and Path(path).parent == Path(m[1]) for m in mounts)


def test_s3_endpoint_keys_and_bucket_agree(tmp_path: Path) -> None:
    spec = load()
    services = spec["services"]
    s3 = services["s3"]
    weed = [str(a) for a in s3["command"]]
    flags = dict(a.lstrip("-").split("=", 1) for a in weed if a.startswith("-") and "=" in a)
    assert "server" in weed and "-s3" in weed
    for name, service in [*diloco_services(spec).items(), ("seed", services["seed"])]:
        env = service["environment"]
        endpoint = urlparse(env["AWS_ENDPOINT_URL"])
        assert (endpoint.hostname, str(endpoint.port)) == ("s3", flags["s3.port"]), name
        assert env["AWS_DEFAULT_REGION"], name
        # No key in the file or the repo: the clients read the one the `secrets` service made,
        # from the same volume the object store reads its identities (-s3.config) from.
        assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env, name
        assert in_secrets_volume(service, env["AWS_SHARED_CREDENTIALS_FILE"]), name
    assert in_secrets_volume(s3, flags["s3.config"])
    # ... which are the files that service makes, into the volume it mounts there.
    made = services["secrets"]
    assert made["entrypoint"] == ["python", "/opt/diloco/" + SECRETS_SCRIPT.name]
    assert made["command"] == [str(Path(flags["s3.config"]).parent)]
    names = {Path(flags["s3.config"]).name, Path(env["AWS_SHARED_CREDENTIALS_FILE"]).name, "token"}
    assert set(make_secrets(tmp_path)) == names
    assert not (ROOT / "docker" / "s3.json").exists()
    healthcheck = " ".join(s3["healthcheck"]["test"])
    assert f":{flags['s3.port']}/" in healthcheck
    # The seed writes the corpus where the coordinator reads it, in the bucket the store uses.
    coord = parse_diloco(services["coordinator"]["command"]).params
    seeded = services["seed"]["command"][-1].rstrip("/")
    assert coord["dataset"].rstrip("/") == seeded
    assert urlparse(coord["store"]).netloc == urlparse(seeded).netloc


def test_start_order_and_the_image() -> None:
    spec = load()
    services = spec["services"]
    assert services["seed"]["depends_on"]["s3"]["condition"] == "service_healthy"
    assert services["coordinator"]["depends_on"]["seed"]["condition"] == "service_completed_successfully"
    for name in ("s3", "coordinator"):  # the object store's key and the token come first
        assert services[name]["depends_on"]["secrets"]["condition"] == "service_completed_successfully"
    built = [s for s in services.values() if "build" in s]
    assert len(built) == 1, "one service builds the image; the others use it"
    assert (ROOT / built[0]["build"]["context"] / built[0]["build"]["dockerfile"]).resolve() == DOCKERFILE
    for name in ("seed", "coordinator", "data", "compute"):
        assert services[name]["image"] == built[0]["image"], name
    # The seed runs the script the Dockerfile copies into the image.
    dockerfile = DOCKERFILE.read_text()
    script_in_image = services["seed"]["entrypoint"][-1]
    assert f"COPY docker/{SEED_SCRIPT.name} ./{Path(script_in_image).name}" in dockerfile
    assert f"COPY docker/{SECRETS_SCRIPT.name} ./{SECRETS_SCRIPT.name}" in dockerfile
    # The secrets volume is written by the image's user: its mount point is that user's.
    assert "mkdir -p /var/lib/diloco /run/diloco" in dockerfile and "chown diloco" in dockerfile
    assert "WORKDIR " + str(Path(script_in_image).parent) in dockerfile
    assert 'ENTRYPOINT ["diloco"]' in dockerfile


def test_docker_compose_config_validates() -> None:
    binary = shutil.which("docker-compose")
    if binary is None:
        if os.environ.get("CI"):  # .ci/run installs it: missing there is a failure, not a skip
            pytest.fail("docker-compose is not installed (.ci/run installs it with apt-get)")
        pytest.skip("docker-compose is not installed (apt-get install docker-compose)")
    result = subprocess.run(
        [binary, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr


def test_seed_script_uploads_the_stdlib_corpus_once_with_the_key_made_at_first_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the `secrets` and `seed` services run, against a real S3 server serving the identities
    file the first made: the seed, holding only the credentials file, makes the bucket and uploads
    the corpus once; the coordinator then finds it; a client without that key is refused."""
    secrets_dir = tmp_path / "secrets"
    assert set(make_secrets(secrets_dir)) == {"token", "s3.json", "aws-credentials"}
    kept = {p.name: p.read_bytes() for p in secrets_dir.iterdir()}
    assert make_secrets(secrets_dir) == [] and kept == {p.name: p.read_bytes() for p in secrets_dir.iterdir()}
    assert oct((secrets_dir / "aws-credentials").stat().st_mode & 0o777) == "0o600"
    with SeaweedS3(tmp_path / "s3", identities=secrets_dir / "s3.json") as server:
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "AWS_ENDPOINT_URL": server.endpoint,
            "AWS_DEFAULT_REGION": server.region,
            "AWS_SHARED_CREDENTIALS_FILE": str(secrets_dir / "aws-credentials"),
        }
        target = "s3://diloco/corpus"

        def seed(environment: dict[str, str], timeout_s: float = 60) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, str(SEED_SCRIPT), target, "--timeout", str(timeout_s)],
                env=environment,
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=170,
            )

        n = len(stdlib_files())
        first = seed(env)
        assert first.returncode == 0, first.stderr
        assert f"{n} of {n} files uploaded" in first.stdout
        assert f"0 of {n} files uploaded" in seed(env).stdout  # a second `up` uploads nothing
        stranger = {**env, "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
                    "AWS_ACCESS_KEY_ID": "diloco-demo-key", "AWS_SECRET_ACCESS_KEY": "diloco-demo-secret"}  # fmt: skip
        refused = seed(stranger, timeout_s=2)
        assert refused.returncode != 0 and "cannot create bucket" in refused.stderr, refused.stderr
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
        assert len(resolve_dataset(target + "/")) == n
