"""What to submit to run an rl_tpu config on a GKE TPU slice (`python -m launch.pod`).

`jobset(run)` is a Kubernetes JobSet (jobset.x-k8s.io/v1alpha2) with one replicated Job of one
pod per TPU host (VM): each pod asks for its host's chips and runs the same `python -m
launch.train` command, and every pod mounts the same ReadWriteMany volume, where the run's
workdir lives. `xpk_command(run, cluster)` is the `xpk workload create` command line that has
xpk build the same JobSet. `jobset_yaml` writes the manifest as YAML (`to_yaml`, no YAML
package needed); `topology_slice` reads a topology as `launch.compile_check` takes it
(`v5p:4x4x4`).

The GKE and xpk facts encoded here, as GKE's TPU pages, the JobSet project and xpk's own source
give them:
- node labels: `cloud.google.com/gke-tpu-accelerator` (tpu-v4-podslice, tpu-v5-lite-podslice,
  tpu-v5p-slice, tpu-v6e-slice) and `cloud.google.com/gke-tpu-topology` (the shape, `4x4x4`);
- a multi-host slice's VMs have 4 chips each (machine types ct4p-hightpu-4t, ct5lp-hightpu-4t,
  ct5p-hightpu-4t, ct6e-standard-4t), so a pod requests `google.com/tpu: 4`; a one-chip slice
  is one VM of one chip. (v5e and v6e also offer an 8-chip VM, one host for a 2x4 slice, meant
  for serving; this module lays 2x4 out as xpk does, on two 4-chip VMs.)
- xpk's `--tpu-type` counts TensorCores: 2 a chip on v4 and v5p (v5p:4x4x4, 64 chips, is
  v5p-128), 1 on v5e (named v5litepod: v5e:4x4 is v5litepod-16) and v6e (v6e:8x8 is v6e-64).
"""

import dataclasses
import json
import math
import re
import shlex

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
TPU_RESOURCE = "google.com/tpu"
# JobSet places each child Job's pods in one node pool, which on GKE is one TPU slice: without
# it, a cluster with two pools of the same topology could split the run's hosts between them.
JOBSET_ANNOTATIONS = {
    "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
# The pod annotation that has GKE's Cloud Storage FUSE driver inject its sidecar; a pod
# mounting a GCS FUSE volume without it cannot mount it.
GCSFUSE_ANNOTATION = "gke-gcsfuse/volumes"
REPLICATED_JOB = "slice"
CONTAINER = "rl-tpu"
VOLUME = "workdir"
CHIPS_PER_VM = 4
# A JobSet's pods are named <name>-slice-<job>-<pod>-<5 random characters>, a DNS label of at
# most 63 characters; xpk takes workload names of at most 40 (`[a-z]([-a-z0-9]*[a-z0-9])?`),
# which leaves room for 4-digit pod indices, more than the largest slice has hosts (2240).
NAME_PATTERN = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME_LENGTH = 40
# On SIGTERM rl_tpu finishes the step and checkpoints before it exits (docs/training.md);
# Kubernetes' default 30 s would kill it in the middle of a large checkpoint. A checkpoint cut
# short is never restored, so a longer wait only saves the step's work.
TERMINATION_GRACE_S = 300


@dataclasses.dataclass(frozen=True)
class ChipKind:
    """A TPU generation as GKE and xpk name it."""

    gke_accelerator: str  # the node label's value
    xpk_prefix: str  # xpk's --tpu-type is <prefix>-<TensorCores>
    tensorcores_per_chip: int
    dims: int  # 3: AxBxC, small shapes or sides of multiples of 4; 2: one of SHAPES_2D
    max_chips: int  # a whole pod's


# The v5e and v6e slice shapes GKE and the Cloud TPU pages list.
SHAPES_2D = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")
# 3D slices below a 4x4x4 cube; larger ones have every side a multiple of 4.
SMALL_SHAPES_3D = ((2, 2, 1), (2, 2, 2), (2, 2, 4), (2, 4, 4))

CHIP_KINDS = {
    "v4": ChipKind("tpu-v4-podslice", "v4", 2, 3, 4096),
    "v5e": ChipKind("tpu-v5-lite-podslice", "v5litepod", 1, 2, 256),
    "v5p": ChipKind("tpu-v5p-slice", "v5p", 2, 3, 8960),
    "v6e": ChipKind("tpu-v6e-slice", "v6e", 1, 2, 256),
}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A TPU slice: its chip kind, shape (`4x4x4`), chips and the hosts (VMs) they sit on."""

    chip: str
    shape: str
    chips: int
    hosts: int
    chips_per_host: int

    @property
    def kind(self) -> ChipKind:
        return CHIP_KINDS[self.chip]

    @property
    def xpk_tpu_type(self) -> str:
        return f"{self.kind.xpk_prefix}-{self.chips * self.kind.tensorcores_per_chip}"


def topology_slice(topology: str) -> Slice:
    """The `Slice` of a topology written `<chip>:<shape>` (`v5p:4x4x4`, `v5e:4x4`); a
    ValueError names what is wrong with one GKE has no node pool for."""
    chip, sep, shape = topology.strip().lower().partition(":")
    example = "e.g. v5p:4x4x4, v5e:4x4 or v6e:8x8"
    if not sep or chip not in CHIP_KINDS:
        raise ValueError(f"--topology={topology!r}: write <chip>:<shape> with chip one of "
                         f"{', '.join(sorted(CHIP_KINDS))}, {example}")
    kind = CHIP_KINDS[chip]
    if not re.fullmatch(r"[1-9][0-9]*(x[1-9][0-9]*)+", shape):
        raise ValueError(f"--topology={topology!r}: the shape is chips along each axis joined "
                         f"by 'x', {example}")
    sides = tuple(int(n) for n in shape.split("x"))
    chips = math.prod(sides)
    if kind.dims == 2 and shape not in SHAPES_2D:
        raise ValueError(f"--topology={topology!r}: {chip} slices are 2D, one of "
                         f"{', '.join(SHAPES_2D)} (a whole {chip} pod: {kind.max_chips} chips)")
    if kind.dims == 3:
        if len(sides) != 3:
            raise ValueError(f"--topology={topology!r}: {chip} slices are 3D (AxBxC), e.g. "
                             f"{chip}:4x4x4")
        if sides not in SMALL_SHAPES_3D and any(n % 4 for n in sides):
            raise ValueError(f"--topology={topology!r}: a {chip} slice is one of "
                             f"{', '.join('x'.join(map(str, s)) for s in SMALL_SHAPES_3D)} or "
                             f"has every side a multiple of 4 (4x4x4, 4x4x8, 4x8x8, ...)")
        if chips > kind.max_chips:
            raise ValueError(f"--topology={topology!r}: {chips} chips, more than a whole {chip} "
                             f"pod ({kind.max_chips})")
    per_host = min(chips, CHIPS_PER_VM)
    return Slice(chip, shape, chips, chips // per_host, per_host)


@dataclasses.dataclass(frozen=True)
class PodRun:
    """One rl_tpu run on a GKE TPU slice.

    config: `configs/X.py[:variant]`, relative to the image's working directory (its rl_tpu
    checkout); overrides: launch.train's flags after it (`--config.mesh.expert=8`); workdir:
    a path under `mount_path`, where every pod mounts the ReadWriteMany claim `claim` (Filestore
    or a GCS FUSE bucket; `gcsfuse` adds the annotation the FUSE driver needs);
    max_restarts: how often the JobSet reruns after a failure.
    """

    config: str
    topology: str
    image: str
    name: str
    workdir: str
    claim: str
    overrides: tuple[str, ...] = ()
    mount_path: str = "/mnt/shared"
    max_restarts: int = 3
    gcsfuse: bool = False

    def __post_init__(self):
        topology_slice(self.topology)  # raises on a bad topology
        if not self.image.strip():
            raise ValueError("--image is empty: give the container image that holds rl_tpu "
                             "and JAX for TPU, e.g. us-docker.pkg.dev/PROJECT/REPO/rl_tpu:TAG")
        if not (NAME_PATTERN.fullmatch(self.name) and len(self.name) <= MAX_NAME_LENGTH):
            raise ValueError(f"--name={self.name!r}: a job name is lowercase letters, digits and "
                             f"'-', starts with a letter, ends with a letter or digit, and has "
                             f"at most {MAX_NAME_LENGTH} characters (it names the pods and "
                             "the xpk workload), e.g. babyai-7b")
        if not self.config.split(":", 1)[0].endswith(".py"):
            raise ValueError(f"--config={self.config!r}: give the config file as the trainer "
                             "takes it, configs/X.py[:variant]")
        if not self.claim.strip():
            raise ValueError("--pvc is empty: give the PersistentVolumeClaim (ReadWriteMany: "
                             "Filestore or GCS FUSE) that holds the workdir every host writes")
        mount = self.mount_path.rstrip("/")
        if not (mount.startswith("/") and self.workdir.startswith(mount + "/")):
            raise ValueError(f"--workdir={self.workdir!r} is not under the shared volume's mount "
                             f"point {self.mount_path!r}: every host writes the run's "
                             "checkpoints there, so put the workdir on it (or move --mount_path)")
        for arg in self.overrides:
            if not arg.startswith("--"):
                raise ValueError(f"override {arg!r}: launch.train's flags only, written "
                                 "--config.key=value (after `--`)")
            if arg.split("=", 1)[0] in ("--config", "--workdir"):
                raise ValueError(f"override {arg!r}: --config and --workdir are launch.pod's "
                                 "own flags; give them before `--`")
        if self.max_restarts < 0:
            raise ValueError(f"--max_restarts={self.max_restarts}: a count, 0 or more")

    @property
    def slice(self) -> Slice:
        return topology_slice(self.topology)

    @property
    def compilation_cache(self) -> str:
        return f"{self.mount_path.rstrip('/')}/jax_compilation_cache"


def train_command(run: PodRun) -> list[str]:
    """The command every host runs: launch.train on the run's config, workdir and overrides."""
    return ["python", "-m", "launch.train", "--config", run.config, "--workdir", run.workdir,
            *run.overrides]


def container_env(run: PodRun) -> dict[str, str]:
    """The environment rl_tpu reads in each pod.

    Several hosts join one JAX job through RL_TPU_DISTRIBUTED=1, which
    rl_tpu.parallel.maybe_initialize_distributed turns into `jax.distributed.initialize()`.
    On GKE that finds its place from TPU_WORKER_ID and TPU_WORKER_HOSTNAMES, which GKE's TPU
    webhook sets in every pod of an indexed Job that asks for google.com/tpu (with more than
    one pod and a subdomain, which JobSet gives its Jobs). libtpu needs those same variables
    to connect the hosts' chips, so they are there whatever JAX is told: reading them keeps one
    source for both, and the same setting serves the xpk command, whose pod names are xpk's to
    choose (an explicit JAX_COORDINATOR_ADDRESS would have to spell them). One host needs no
    distributed start, and GKE sets no worker list for a lone pod, so it gets none.

    JAX_COMPILATION_CACHE_DIR puts the persistent compilation cache on the shared volume, so a
    restarted JobSet loads its programs instead of compiling them again on fresh pods (JAX
    writes cache entries from process 0 only, so the hosts do not race on it)."""
    env = {"JAX_COMPILATION_CACHE_DIR": run.compilation_cache}
    if run.slice.hosts > 1:
        env["RL_TPU_DISTRIBUTED"] = "1"
    return env


def jobset(run: PodRun) -> dict:
    """The JobSet manifest of `run` (see the module docstring)."""
    tpu = run.slice
    pod_annotations = {GCSFUSE_ANNOTATION: "true"} if run.gcsfuse else {}
    container = {
        "name": CONTAINER,
        "image": run.image,
        "command": train_command(run),
        "env": [{"name": k, "value": v} for k, v in container_env(run).items()],
        "resources": {"limits": {TPU_RESOURCE: tpu.chips_per_host}},
        "volumeMounts": [{"name": VOLUME, "mountPath": run.mount_path}],
    }
    pod_spec = {
        "restartPolicy": "Never",
        # GKE's multi-host TPU examples and xpk's JobSets run TPU pods on the host's network
        # (the hosts' traffic skips the pod network); ClusterFirstWithHostNet keeps cluster
        # DNS, which resolves the JobSet's pod names, for such a pod.
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        "nodeSelector": {ACCELERATOR_LABEL: tpu.kind.gke_accelerator, TOPOLOGY_LABEL: tpu.shape},
        "containers": [container],
        "volumes": [{"name": VOLUME, "persistentVolumeClaim": {"claimName": run.claim}}],
    }
    pod_template = {"spec": pod_spec}
    if pod_annotations:
        pod_template["metadata"] = {"annotations": pod_annotations}
    job_spec = {
        # one pod per host, all at once, each with its completion index (GKE's TPU_WORKER_ID)
        "parallelism": tpu.hosts,
        "completions": tpu.hosts,
        "completionMode": "Indexed",
        # One host lost stops the whole JAX job, so the Job fails at the first failed pod and
        # the JobSet's failure policy restarts every pod together.
        "backoffLimit": 0,
        "template": pod_template,
    }
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": run.name, "annotations": dict(JOBSET_ANNOTATIONS)},
        "spec": {
            # Any failure restarts the whole JobSet, up to max_restarts times. A restart
            # recreates every pod with the same command, and launch.train resumes from the
            # workdir's last complete checkpoint, so a restart is safe and loses at most the
            # steps since that checkpoint.
            "failurePolicy": {"maxRestarts": run.max_restarts},
            "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1,
                                "template": {"spec": job_spec}}],
        },
    }


def jobset_yaml(run: PodRun) -> str:
    """`jobset(run)` as a YAML document, headed by a comment saying what it runs."""
    tpu = run.slice
    head = (f"# rl_tpu: {run.config} on {run.topology} ({tpu.chips} chips, {tpu.hosts} hosts of "
            f"{tpu.chips_per_host}); submit with: kubectl apply -f {run.name}.jobset.yaml\n")
    return head + to_yaml(jobset(run))


def xpk_command(run: PodRun, cluster: str = "") -> str:
    """A shell script that creates the same run with `xpk workload create` on `cluster` (empty:
    the script takes it from $CLUSTER).

    xpk builds its own JobSet (one replicated Job of `hosts` pods on the host network, at most
    `--max-restarts` restarts) and mounts storage it attached itself, so the claim is named
    here as an xpk storage, attached once with `xpk storage attach`."""
    if cluster and not NAME_PATTERN.fullmatch(cluster):
        raise ValueError(f"--cluster={cluster!r}: the GKE cluster xpk submits to (lowercase "
                         "letters, digits and '-')")
    tpu = run.slice
    flags = [("workload", run.name), ("tpu-type", tpu.xpk_tpu_type), ("num-slices", "1"),
             ("docker-image", run.image), ("max-restarts", str(run.max_restarts)),
             ("storage", run.claim)]
    flags += [("env", f"{k}={v}") for k, v in container_env(run).items()]
    flags.append(("command", shlex.join(train_command(run))))
    cluster_arg = shlex.quote(cluster) if cluster else '"${CLUSTER:?set CLUSTER to the cluster}"'
    lines = [
        "#!/bin/sh",
        f"# rl_tpu: {run.config} on {run.topology} ({tpu.chips} chips, {tpu.hosts} hosts of "
        f"{tpu.chips_per_host}) with xpk;",
        f"# --tpu-type counts TensorCores: {tpu.xpk_tpu_type} is {tpu.chips} chips of "
        f"{tpu.kind.tensorcores_per_chip}. The workdir's volume is the xpk storage {run.claim},",
        f"# attached once with: xpk storage attach {run.claim} --cluster={cluster or '$CLUSTER'}",
        "#     --type=gcpfilestore (or gcsfuse) "
        f"--mount-point={run.mount_path} --auto-mount=false --readonly=false ...",
        "xpk workload create \\",
        f"  --cluster={cluster_arg} \\",
    ]
    lines += [f"  --{flag}={shlex.quote(value)} \\" for flag, value in flags[:-1]]
    flag, value = flags[-1]
    lines.append(f"  --{flag}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


# YAML 1.1 reads these plain words as booleans or null (PyYAML and kubectl's parser both do).
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _scalar(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if not isinstance(value, str):
        raise TypeError(f"no YAML form for {type(value).__name__} {value!r}")
    # Plain when it cannot read back as anything but this string: it starts with a letter (no
    # number, indicator or document marker does) and has no character YAML gives a meaning to.
    if re.fullmatch(r"[A-Za-z][A-Za-z0-9_./-]*", value) and value.lower() not in _YAML_WORDS:
        return value
    return json.dumps(value)  # a JSON string is a double-quoted YAML scalar


def _inline(value):
    """A value's one-line YAML: a scalar or an empty dict or list; None for a block."""
    if isinstance(value, dict):
        return None if value else "{}"
    if isinstance(value, list):
        return None if value else "[]"
    return _scalar(value)


def to_yaml(value, indent: int = 0) -> str:
    """Block-style YAML of dicts, lists, strings, ints and bools, as the JobSet needs: strings
    that could read back as another type or need escapes are double-quoted."""
    pad = " " * indent
    inline = _inline(value)
    if inline is not None:
        return f"{pad}{inline}\n"
    out = []
    if isinstance(value, dict):
        for key, item in value.items():
            inline = _inline(item)
            out.append(f"{pad}{_scalar(key)}: {inline}\n" if inline is not None
                       else f"{pad}{_scalar(key)}:\n{to_yaml(item, indent + 2)}")
    else:
        for item in value:  # the item's block indented past the dash, the dash on its first line
            out.append(f"{pad}- {to_yaml(item, indent + 2)[indent + 2:]}")
    return "".join(out)
