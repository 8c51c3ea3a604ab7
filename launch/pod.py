"""Submitting a run to a TPU slice on GKE: a JobSet manifest and the equivalent xpk command.

  python -m launch.pod --config configs/X.py[:variant] --topology v5p:4x4x4 --image IMAGE
      --name NAME --workdir /mnt/shared/runs/R --pvc CLAIM --out DIR [--cluster C]
      [-- --config.key=value ...]

Writes DIR/NAME.jobset.yaml, a JobSet that runs `python -m launch.train` on every host of the
slice (one pod per TPU VM, the workdir on the ReadWriteMany claim CLAIM mounted at
--mount_path on each), and DIR/NAME.xpk.sh, the `xpk workload create` command for the same run;
then prints the commands that submit them (rl_tpu/pod_manifest.py says what goes in them).
Everything after `--` is passed to launch.train as it stands: config overrides
(`--config.mesh.expert=8`, `--config.model.path=/mnt/shared/models/M`) and its other flags.
The config file must exist here; it is not loaded (the container runs it from the image's
checkout, at the same relative path). A bad topology, name or image stops with one line on
stderr and exit status 2.
"""

import os

from absl import app, flags

import launch
from rl_tpu import pod_manifest

flags.DEFINE_string("config", None, "The config as launch.train takes it: configs/X.py[:variant] "
                    "(relative to the image's rl_tpu checkout).")
flags.DEFINE_string("topology", None, "The TPU slice, <chip>:<shape> as launch.compile_check "
                    "takes it: v5p:4x4x4, v5e:4x4, v6e:8x8, v4:2x2x4.")
flags.DEFINE_string("image", None, "Container image with rl_tpu (its checkout as the working "
                    "directory) and JAX for TPU.")
flags.DEFINE_string("name", None, "Job name: the JobSet's and the xpk workload's (lowercase, "
                    "digits, '-'; at most 40 characters).")
flags.DEFINE_string("workdir", None, "The run's workdir, under --mount_path: checkpoints, "
                    "metrics and exports; a rerun resumes from it.")
flags.DEFINE_string("pvc", None, "The ReadWriteMany PersistentVolumeClaim (Filestore, GCS FUSE) "
                    "mounted at --mount_path on every host; for xpk, its storage of that name.")
flags.DEFINE_string("out", None, "Directory to write <name>.jobset.yaml and <name>.xpk.sh in.")
flags.DEFINE_string("cluster", "", "The GKE cluster, for the xpk command (empty: the script "
                    "reads $CLUSTER).")
flags.DEFINE_string("mount_path", "/mnt/shared", "Where each pod mounts --pvc.")
flags.DEFINE_integer("max_restarts", 3, "Times the JobSet is restarted after a failure (each "
                     "restart resumes from the last checkpoint).")
flags.DEFINE_bool("gcsfuse", False, "--pvc is a Cloud Storage FUSE volume: annotate the pods "
                  "for GKE's FUSE sidecar.")
flags.mark_flags_as_required(["config", "topology", "image", "name", "workdir", "pvc", "out"])


def main(argv):
    f = flags.FLAGS
    config_file = f.config.split(":", 1)[0]
    if not os.path.isfile(config_file):
        raise ValueError(f"--config={config_file}: no such config file (give it relative to "
                         "the rl_tpu checkout, as the container runs it)")
    run = pod_manifest.PodRun(config=f.config, topology=f.topology, image=f.image, name=f.name,
                              workdir=f.workdir, claim=f.pvc, overrides=tuple(argv[1:]),
                              mount_path=f.mount_path, max_restarts=f.max_restarts,
                              gcsfuse=f.gcsfuse)
    xpk_script = pod_manifest.xpk_command(run, f.cluster)
    os.makedirs(f.out, exist_ok=True)
    manifest_path = os.path.join(f.out, f"{run.name}.jobset.yaml")
    xpk_path = os.path.join(f.out, f"{run.name}.xpk.sh")
    with open(manifest_path, "w", encoding="utf-8") as out:
        out.write(pod_manifest.jobset_yaml(run))
    with open(xpk_path, "w", encoding="utf-8") as out:
        out.write(xpk_script)
    os.chmod(xpk_path, 0o755)
    tpu = run.slice
    print(f"{run.config} on {run.topology}: {tpu.hosts} pods of {tpu.chips_per_host} chips "
          f"({tpu.chips} chips), workdir {run.workdir} on claim {run.claim}")
    print(f"wrote {manifest_path}\nwrote {xpk_path}\n")
    set_cluster = "" if f.cluster else "CLUSTER=<cluster> "  # the script reads $CLUSTER
    print(f"submit with kubectl (the cluster has JobSet installed):\n  kubectl apply -f "
          f"{manifest_path}\nor with xpk:\n  {set_cluster}sh {xpk_path}")


if __name__ == "__main__":
    app.run(lambda argv: launch.one_line_errors((ValueError, OSError), main, argv),
            flags_parser=lambda argv: launch.one_line_errors(
                (flags.Error,), launch.parse_flags, argv))
