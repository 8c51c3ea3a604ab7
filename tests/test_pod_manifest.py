"""`python -m launch.pod` and rl_tpu/pod_manifest.py: the JobSet it writes is valid against the
JobSet CRD's own schema (tests/data/jobset/), lays the slice out as GKE runs it (one pod per
4-chip TPU VM) and as rl_tpu/aot.py's abstract topologies do, runs launch.train with the config
and its overrides, and gives rl_tpu.parallel.maybe_initialize_distributed the environment it
reads; the xpk command is the same run; bad input is refused by name. No JAX compile: the
topology check asks libtpu for device lists only, in a subprocess (as tests/test_aot.py does)."""

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys

import jax
import jsonschema
import pytest
import yaml

from rl_tpu import parallel
from rl_tpu import pod_manifest as pm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMA = os.path.join(ROOT, "tests", "data", "jobset", "jobset-v1alpha2.schema.json")
CONFIG = "configs/agentgym.py:babyai"
OVERRIDES = ("--config.mesh.expert=8", "--config.model.path=/mnt/shared/models/Qwen2.5-7B",
             "--rollout_urls=http://gpu-1:30000,http://gpu-2:30000")


def pod_run(topology="v5p:4x4x4", **changes) -> pm.PodRun:
    fields = dict(config=CONFIG, topology=topology, image="us-docker.pkg.dev/p/r/rl_tpu:v1",
                  name="babyai-7b", workdir="/mnt/shared/runs/babyai_7b", claim="shared-rwx",
                  overrides=OVERRIDES)
    return pm.PodRun(**{**fields, **changes})


def closed(schema):
    """`schema` with every object that lists its properties closed to others: the API server
    silently drops a field its structural schema does not name, so a misspelt field would
    pass the open schema and then be lost."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed(v) if k != "properties" else {p: closed(s) for p, s in v.items()})
           for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def jobset_validator():
    with open(SCHEMA, encoding="utf-8") as f:
        schema = closed(json.load(f))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def the_container(manifest) -> dict:
    (replicated,) = manifest["spec"]["replicatedJobs"]
    (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    return container


# topology -> chips, hosts, chips per host, GKE's accelerator label, xpk's --tpu-type
SLICES = {
    "v5p:4x4x4": (64, 16, 4, "tpu-v5p-slice", "v5p-128"),  # a v5p chip has 2 TensorCores
    "v5e:4x4": (16, 4, 4, "tpu-v5-lite-podslice", "v5litepod-16"),  # 4 chips a v5e VM
    "v6e:8x8": (64, 16, 4, "tpu-v6e-slice", "v6e-64"),
    "v4:2x2x4": (16, 4, 4, "tpu-v4-podslice", "v4-32"),
    "v5p:2x2x1": (4, 1, 4, "tpu-v5p-slice", "v5p-8"),
    "v5e:1x1": (1, 1, 1, "tpu-v5-lite-podslice", "v5litepod-1"),
}


@pytest.mark.parametrize("topology", sorted(SLICES))
def test_a_slice_has_the_hosts_and_chips_gke_runs_it_on(topology):
    chips, hosts, per_host, accelerator, tpu_type = SLICES[topology]
    tpu = pm.topology_slice(topology)
    assert (tpu.chips, tpu.hosts, tpu.chips_per_host) == (chips, hosts, per_host)
    assert (tpu.kind.gke_accelerator, tpu.xpk_tpu_type) == (accelerator, tpu_type)
    manifest = pm.jobset(pod_run(topology))
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == hosts
    assert job["template"]["spec"]["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": accelerator,
        "cloud.google.com/gke-tpu-topology": topology.split(":")[1]}
    assert the_container(manifest)["resources"]["limits"] == {"google.com/tpu": per_host}


# Run with libtpu's abstract topologies (rl_tpu.aot.topology_devices): per topology, the
# devices and the hosts (process indices) libtpu lays them out on.
AOT_LAYOUT = """
import json, os, sys
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
from rl_tpu import aot
out = {}
for name in sys.argv[1:]:
    devices = aot.topology_devices(name)[0]
    out[name] = [len(devices), len({d.process_index for d in devices})]
print(json.dumps(out))
"""


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]')")
def test_the_layout_agrees_with_aots_abstract_topologies():
    topologies = ["v5p:4x4x4", "v5e:4x4", "v6e:8x8", "v4:2x2x4", "v5e:2x4", "v6e:2x2",
                  "v5p:2x2x2"]
    run = subprocess.run([sys.executable, "-c", AOT_LAYOUT, *topologies], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0, run.stderr[-2000:]
    layout = json.loads(run.stdout.strip().splitlines()[-1])
    for topology, (devices, hosts) in layout.items():
        tpu = pm.topology_slice(topology)
        assert tpu.hosts == hosts, topology
        if tpu.chip != "v4":  # libtpu lists a v4 chip's two TensorCores as two devices
            assert tpu.chips == devices, topology


@pytest.mark.parametrize("run", [pod_run(), pod_run("v5e:2x2", gcsfuse=True, overrides=()),
                                 pod_run("v6e:8x8", max_restarts=0)],
                         ids=["v5p_multi_host", "v5e_one_host_gcsfuse", "v6e_no_restarts"])
def test_the_manifest_is_a_valid_jobset_and_its_yaml_reads_back(run, jobset_validator):
    manifest = pm.jobset(run)
    jobset_validator.validate(manifest)
    assert yaml.safe_load(pm.jobset_yaml(run)) == manifest


def test_the_closed_schema_catches_a_misspelt_field(jobset_validator):
    manifest = pm.jobset(pod_run())
    pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["hostNetwrok"] = pod.pop("hostNetwork")
    with pytest.raises(jsonschema.ValidationError, match="hostNetwrok"):
        jobset_validator.validate(manifest)
    bad = pm.jobset(pod_run())
    bad["spec"]["failurePolicy"]["maxRestarts"] = "three"
    with pytest.raises(jsonschema.ValidationError, match="three"):
        jobset_validator.validate(bad)


def test_the_jobset_runs_one_slice_that_restarts_together():
    manifest = pm.jobset(pod_run(max_restarts=5))
    assert manifest["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and manifest["kind"] == "JobSet"
    assert manifest["metadata"] == {"name": "babyai-7b", "annotations": {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}}
    assert manifest["spec"]["failurePolicy"] == {"maxRestarts": 5}
    (replicated,) = manifest["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 1
    job = replicated["template"]["spec"]
    assert (job["backoffLimit"], job["completionMode"]) == (0, "Indexed")
    pod = job["template"]["spec"]
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["restartPolicy"] == "Never"
    assert pod["volumes"] == [{"name": "workdir",
                               "persistentVolumeClaim": {"claimName": "shared-rwx"}}]
    assert the_container(manifest)["volumeMounts"] == [{"name": "workdir",
                                                       "mountPath": "/mnt/shared"}]
    assert "metadata" not in job["template"]  # no GCS FUSE sidecar unless asked
    fuse = pm.jobset(pod_run(gcsfuse=True))["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert fuse["template"]["metadata"] == {"annotations": {"gke-gcsfuse/volumes": "true"}}


def test_the_command_carries_the_config_and_overrides():
    container = the_container(pm.jobset(pod_run()))
    assert container["image"] == "us-docker.pkg.dev/p/r/rl_tpu:v1"
    assert container["command"] == ["python", "-m", "launch.train", "--config", CONFIG,
                                    "--workdir", "/mnt/shared/runs/babyai_7b", *OVERRIDES]


@pytest.mark.parametrize("topology,joins", [("v5p:4x4x4", True), ("v5e:2x2", False)])
def test_the_env_is_what_maybe_initialize_distributed_reads(topology, joins, monkeypatch):
    env = {e["name"]: e["value"] for e in the_container(pm.jobset(pod_run(topology)))["env"]}
    assert env == pm.container_env(pod_run(topology))
    assert env["JAX_COMPILATION_CACHE_DIR"] == "/mnt/shared/jax_compilation_cache"
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
                 "RL_TPU_DISTRIBUTED"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    calls = []
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **k: calls.append((a, k)))
    # Several hosts: jax.distributed.initialize() with no arguments, which on GKE reads the
    # TPU_WORKER_ID and TPU_WORKER_HOSTNAMES GKE's TPU webhook sets; one host: no join.
    assert parallel.maybe_initialize_distributed() is joins
    assert calls == ([((), {})] if joins else [])


def xpk_argv(script: str) -> list[str]:
    """The xpk command line of a script from pm.xpk_command, as the shell splits it."""
    command = " ".join(line.rstrip("\\").strip() for line in script.splitlines()
                       if line.strip() and not line.startswith("#"))
    return shlex.split(command)


def test_the_xpk_command_is_the_same_run():
    run = pod_run()
    argv = xpk_argv(pm.xpk_command(run, "tpu-cluster"))
    assert argv[:3] == ["xpk", "workload", "create"]
    flags = {}
    for arg in argv[3:]:
        name, _, value = arg.partition("=")
        flags.setdefault(name, []).append(value)
    assert flags == {
        "--cluster": ["tpu-cluster"], "--workload": ["babyai-7b"], "--tpu-type": ["v5p-128"],
        "--num-slices": ["1"], "--docker-image": ["us-docker.pkg.dev/p/r/rl_tpu:v1"],
        "--max-restarts": ["3"], "--storage": ["shared-rwx"],
        "--env": [f"{k}={v}" for k, v in pm.container_env(run).items()],
        "--command": [shlex.join(pm.train_command(run))]}
    assert shlex.split(flags["--command"][0]) == the_container(pm.jobset(run))["command"]


def test_the_xpk_script_runs_xpk_with_those_arguments(tmp_path):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "xpk").write_text(f"#!{sys.executable}\nimport json, sys\n"
                                  "print(json.dumps(sys.argv[1:]))\n")
    (fake_bin / "xpk").chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text(pm.xpk_command(pod_run()))  # no --cluster: the script reads $CLUSTER
    env = dict(os.environ, PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    env.pop("CLUSTER", None)
    unset = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True)
    assert unset.returncode != 0 and "set CLUSTER" in unset.stderr
    ran = subprocess.run(["sh", str(script)], env=dict(env, CLUSTER="tpu-cluster"),
                         capture_output=True, text=True, check=True)
    expected = xpk_argv(pm.xpk_command(pod_run(), "tpu-cluster"))[1:]
    assert json.loads(ran.stdout) == expected


@pytest.mark.parametrize("change,named", [
    (dict(topology="v7x:2x2"), "v7x:2x2.*v4, v5e, v5p, v6e"),
    (dict(topology="v5p"), "<chip>:<shape>"),
    (dict(topology="v5e:4x4x4"), "v5e slices are 2D"),
    (dict(topology="v5e:4x6"), "v5e slices are 2D, one of .*4x4"),
    (dict(topology="v5p:4x4"), "v5p slices are 3D"),
    (dict(topology="v5p:2x3x4"), "multiple of 4"),
    (dict(topology="v5p:64x64x64"), "262144 chips, more than a whole v5p pod"),
    (dict(image=" "), "--image is empty"),
    (dict(name="Babyai_7B"), "--name='Babyai_7B'"),
    (dict(name="a" * 41), "at most 40"),
    (dict(config="configs/agentgym"), "configs/X.py"),
    (dict(claim=""), "--pvc is empty"),
    (dict(workdir="/tmp/run"), "not under the shared volume's mount point '/mnt/shared'"),
    (dict(overrides=("config.x=1",)), "override 'config.x=1'"),
    (dict(overrides=("--workdir=/mnt/shared/b",)), "launch.pod's own flags"),
    (dict(max_restarts=-1), "--max_restarts=-1"),
])
def test_bad_input_is_refused_naming_the_problem(change, named):
    with pytest.raises(ValueError, match=named):
        pod_run(**change)


def test_a_bad_cluster_name_is_refused():
    with pytest.raises(ValueError, match="--cluster='Prod Cluster'"):
        pm.xpk_command(pod_run(), "Prod Cluster")


def test_yaml_quotes_what_would_read_back_as_another_type():
    value = {"words": ["on", "no", "Yes", "null", "~"], "numbers": ["8", "1e3", "0x10", "4:4"],
             "flags": ["--config.a=b", "-m"], "odd": ["a: b", "#x", "", "é", "x\ny"],
             "plain": ["launch.train", "tpu-v5p-slice", "google.com/tpu"], "int": 4,
             "empty": {}, "none": [], "nested": [[1, 2], {"a": [True, False]}]}
    text = pm.to_yaml(value)
    assert yaml.safe_load(text) == value
    assert "  - launch.train\n" in text and '  - "on"\n' in text


def test_the_launcher_writes_both_files(tmp_path):
    out = tmp_path / "out"
    args = ["--config", CONFIG, "--topology", "v5p:4x4x4", "--image",
            "us-docker.pkg.dev/p/r/rl_tpu:v1", "--name", "babyai-7b", "--workdir",
            "/mnt/shared/runs/babyai_7b", "--pvc", "shared-rwx", "--out", str(out),
            "--cluster", "tpu-cluster", "--", *OVERRIDES]
    run = subprocess.run([sys.executable, "-m", "launch.pod", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    manifest, script = out / "babyai-7b.jobset.yaml", out / "babyai-7b.xpk.sh"
    assert yaml.safe_load(manifest.read_text()) == pm.jobset(pod_run())
    assert script.read_text() == pm.xpk_command(pod_run(), "tpu-cluster")
    assert os.access(script, os.X_OK)
    assert f"kubectl apply -f {manifest}" in run.stdout and f"sh {script}" in run.stdout
    assert "16 pods of 4 chips (64 chips)" in run.stdout
    missing = subprocess.run([sys.executable, "-m", "launch.pod", *args[:1], "configs/nope.py",
                              *args[2:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert missing.stderr.startswith("error: --config=configs/nope.py: no such config file")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_reads_the_manifest_as_written(tmp_path):
    """kubectl's own YAML reader gives the same object. (`kubectl apply --dry-run=client`
    cannot run without a cluster: even a client dry run asks the API server which resource a
    kind is, and fails with no server; `kubectl label --local` reads the file and needs none,
    but checks no schema, which the CRD's schema test above does.)"""
    path = tmp_path / "jobset.yaml"
    path.write_text(pm.jobset_yaml(pod_run()))
    run = subprocess.run(["kubectl", "label", "--local", "-f", str(path), "-o", "json",
                          "checked=yes"], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, KUBECONFIG=os.devnull))
    assert run.returncode == 0, run.stderr
    read = json.loads(run.stdout)
    assert read["metadata"].pop("labels") == {"checked": "yes"}
    assert read == pm.jobset(pod_run())


def test_the_docs_command_writes_the_excerpt_they_show(tmp_path):
    """docs/tpu_pod.md's `python -m launch.pod` command runs, and writes the manifest the page
    shows an excerpt of."""
    with open(os.path.join(ROOT, "docs", "tpu_pod.md"), encoding="utf-8") as f:
        doc = f.read()
    section = doc.split("## On GKE: a JobSet or xpk", 1)[1]
    command = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "launch.pod"]
    argv[argv.index("--out") + 1] = str(tmp_path)
    run = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    excerpt = section.split("<!-- jobset excerpt -->\n```yaml\n", 1)[1].split("```", 1)[0]
    assert excerpt in (tmp_path / "babyai-7b.jobset.yaml").read_text()
