"""What a run keeps on disk so that it can stop and carry on: checkpoints and what guards them.

    checkpoint            Checkpointer: orbax steps of the sharded train state, with metadata,
                          checksums, host state; restores the newest intact step
    checkpoint_integrity  a checksum per array, computed where its shards are
    checkpoint_errors     a write the disk refuses, as one error naming the step and the path
    host_state            the Python-side state of each host (producer, replay) as checksummed
                          data, never a pickle
    preemption            SIGTERM/SIGINT end the run at a step boundary, checkpointed
    workdir_lock          one trainer per workdir (an OS lock on W/trainer.lock)

rl_tpu.heartbeat stays outside: it prints progress through long phases (evals, server
warm-ups) and keeps nothing. This package imports none of its modules, so that the launchers
can import preemption and workdir_lock before JAX (checkpoint imports orbax and JAX).
"""
