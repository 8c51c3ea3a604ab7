"""Thin command-line entry points; `python -m launch` lists them.

The launchers that take a `--config` (train, sft, eval) start through `launch.run(main)`: the
flags are parsed and the config finished and checked (`finish_config`), and the model
directory, data files and env servers it names checked (`check_inputs`), before `main` builds
or writes anything. A mistake a user can make there (an unknown key, a value of the wrong type,
a failed `check`, a bad env kwarg, a config file, model directory or data file that is not
there or is broken, an env server that is down or serves another env), and a missing file or
package, a damaged model file or a resume under a changed config once the run has started,
ends the process with one line on stderr and exit status 2; RL_TPU_DEBUG=1 shows the full
traceback instead. A start that fails so leaves no workdir behind if it created one and wrote
nothing in it. `--help` prints the flags and exits 0; `--config configs/X.py --list_variants`
prints the file's variants, one line each, and its smoke runs, and exits 0.

They also turn on JAX's persistent compilation cache (`use_compilation_cache`), so a rerun, a
resume and every run of a sweep compile each program once per machine, and on a machine with
no accelerator they default JAX to the CPU (`rl_tpu.jax_platform.default_to_cpu`).
"""

import os
import sys
import warnings

from rl_tpu.jax_platform import default_to_cpu

# Before anything below imports JAX. Every `python -m launch.<name>` runs this package's
# __init__ before the launcher module's own imports, so this one call precedes JAX in each
# launcher (tests/test_launch_cpu_default.py checks every one).
default_to_cpu()

from absl import app, flags, logging  # noqa: E402

from rl_tpu.persistence.preemption import Preempted, PreemptionGuard  # noqa: E402

DEBUG_ENV = "RL_TPU_DEBUG"
CACHE_ENV = "RL_TPU_COMPILATION_CACHE"  # "0": no persistent compilation cache
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "rl_tpu", "jax_compilation_cache")

# What a command line can get wrong while the flags are parsed and the config finished: absl's
# flag errors, ml_collections' (an unknown key is an AttributeError, a bad value a TypeError or
# ValueError, a config file that cannot be read an OSError) and check's ValueErrors.
START_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError,
                 ImportError)
# What a setup can get wrong once the run has started: a path that is not there, a package
# that is not installed; and a run that diverged (rl_tpu.train.learner.NonFiniteParamsError,
# a FloatingPointError naming the step and the last finite checkpoint). Anything else is a
# bug and keeps its traceback.
RUN_ERRORS = (FileNotFoundError, ModuleNotFoundError, FloatingPointError)
HELP_FLAGS = ("--help", "-help", "-?", "--helpshort", "--helpfull", "--helpxml")


def run_errors() -> tuple:
    """RUN_ERRORS and the user's mistakes only the run itself finds, imported when a launcher
    starts (not by `python -m launch`): a model file damaged between the start-up check and
    its load (hf.CheckpointError), a rerun under a config its checkpoint was not saved with
    (resume.ResumeConfigError), and a checkpoint or metrics file the disk refuses
    (checkpoint_errors.RunWriteError: full, read-only, no permission; it names the step, the
    path and the last good checkpoint), and a workdir another trainer holds
    (workdir_lock.WorkdirLockedError: it names the holder), and a run whose episodes all
    end in env errors, step after step (agent.env_failures.EnvFailuresError: it names the
    first error and where the tracebacks are), and a code env on a machine where bubblewrap
    cannot run (sandbox.SandboxUnavailable: it names the override that runs unisolated)."""
    from rl_tpu.agent.env_failures import EnvFailuresError
    from rl_tpu.persistence.checkpoint_errors import RunWriteError
    from rl_tpu.models.hf import CheckpointError
    from rl_tpu.recipes.resume import ResumeConfigError
    from rl_tpu.sandbox.limits import SandboxUnavailable
    from rl_tpu.persistence.workdir_lock import WorkdirLockedError

    return RUN_ERRORS + (CheckpointError, ResumeConfigError, RunWriteError, WorkdirLockedError,
                         EnvFailuresError, SandboxUnavailable)


def run(main, prepare=None, check=None) -> None:
    """`app.run(main)` for a launcher with a `--config` flag (see the module docstring);
    `prepare(config)` applies the launcher's own flags to the config before it is checked,
    `check(config)` then checks what lies outside the config (default none; train and sft pass
    `check_inputs`)."""
    define_list_variants_flag()

    def parse(argv):
        list_variants_if_asked(argv)
        args = parse_flags(argv)
        config = finish_config(prepare=prepare)
        if check:
            check(config)
        return args

    def start_and_main(argv):
        start(argv)
        workdir = flags.FLAGS["workdir"].value if "workdir" in flags.FLAGS else None
        created = bool(workdir) and not os.path.exists(workdir)
        try:
            with PreemptionGuard():  # SIGTERM / SIGINT: the recipe stops after a step, saved
                return main(argv)
        except Preempted as e:  # checkpointed: where it stopped, and how to go on
            print(e, file=sys.stderr, flush=True)
            sys.exit(e.exit_code)
        except BaseException as e:
            if created and not (isinstance(e, SystemExit) and e.code in (0, None)):
                remove_if_nothing_written(workdir)
            raise

    app.run(lambda argv: one_line_errors(run_errors(), start_and_main, argv),
            flags_parser=lambda argv: one_line_errors(START_ERRORS, parse, argv))


def define_list_variants_flag() -> None:
    """`--list_variants`, for a launcher with a `--config` (see list_variants_if_asked)."""
    flags.DEFINE_bool("list_variants", False, "Print the --config file's variants, one line "
                      "each, and its smoke runs, then exit (no other flag is needed).")


def list_variants_if_asked(argv) -> None:
    """With `--list_variants` on the command line: prints what the --config file's variants
    are (rl_tpu.recipes.variants.describe) and exits 0, before the other flags are parsed, so
    that a required one such as --workdir need not be given."""
    if not any(a in ("--list_variants", "--list_variants=true") for a in argv[1:]):
        return
    from rl_tpu.recipes.variants import describe

    path = _config_arg(argv).split(":", 1)[0]
    if not path:
        raise ValueError("--list_variants needs --config=configs/X.py (the config file whose "
                         "variants to list)")
    if not os.path.isfile(path):
        raise OSError(f"--config={path}: no such config file")
    print(describe(path))
    sys.exit(0)


def parse_flags(argv, flag_values: flags.FlagValues = flags.FLAGS):
    """`flag_values(argv)`, where `--help` exits 0 (absl's help flags print the flags, then
    exit with status 1, as if asking for help were an error)."""
    try:
        return flag_values(argv)
    except SystemExit as e:
        if e.code == 1 and any(a.split("=", 1)[0] in HELP_FLAGS for a in argv[1:]):
            sys.exit(0)
        raise


def check_inputs(config, model_path=None) -> None:
    """rl_tpu.recipes.input_checks.check_inputs (imported late: it loads JAX)."""
    from rl_tpu.recipes import input_checks

    input_checks.check_inputs(config, model_path)


def remove_if_nothing_written(workdir: str) -> None:
    """Removes `workdir`, which this run created, if all it holds is empty directories and
    empty files (what a start writes before its first result: a metrics file, checkpoint and
    log directories). Anything with content stays."""
    for root, _, files in os.walk(workdir):
        for name in files:
            try:
                if os.path.getsize(os.path.join(root, name)):
                    return
            except OSError:  # gone, or a broken link: not ours to judge, keep everything
                return
    import shutil

    shutil.rmtree(workdir, ignore_errors=True)


def start(argv) -> None:
    """Common start of the training launchers: no stray positional arguments, and absl logging
    at WARNING unless --verbosity is given (orbax logs every file it writes at INFO)."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not any(arg.startswith(("--verbosity", "-v")) for arg in sys.argv):
        logging.set_verbosity(logging.WARNING)
    use_compilation_cache()


def use_compilation_cache() -> None:
    """JAX's persistent compilation cache: in JAX_COMPILATION_CACHE_DIR if set, else in
    ~/.cache/rl_tpu/jax_compilation_cache; every program, however quick to compile (a run of
    tiny shapes compiles hundreds of sub-second programs), unless
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS says otherwise. RL_TPU_COMPILATION_CACHE=0 turns
    it off. Must run before the first computation: JAX reads the setting when it first
    compiles."""
    if os.environ.get(CACHE_ENV, "1") == "0":
        return
    import jax

    if not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(DEFAULT_CACHE_DIR))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


def finish_config(flag_values: flags.FlagValues = flags.FLAGS, prepare=None):
    """The config the command line asks for, checked: the file's with its overrides, where an
    overridden `algo.name` or `env.name` also rebuilds that block from the new name's defaults
    (`set_algo`: the algo block; `set_env`: env.kwargs) and re-applies the command line's other
    overrides of the block, in their order; then `prepare(config)`, if given. Logs one line for
    each block rebuilt."""
    from rl_tpu.recipes import config as config_lib

    config = flag_values["config"].value
    overrides = flag_values["config"].override_values  # path -> value, command-line order

    def renamed(key: str):  # the config file's value, when the command line changed it
        old = flag_values[f"config.{key}"].default if key in overrides else None
        return old if old is not None and old != overrides[key] else None

    old = renamed("algo.name")
    if old:
        before = config.algo.to_dict()
        config_lib.set_algo(config, config.algo.name, {
            k[len("algo."):]: v for k, v in overrides.items()
            if k.startswith("algo.") and k != "algo.name"})
        changed = [f"{k} {before[k]!r} -> {v!r}" for k, v in config.algo.to_dict().items()
                   if before[k] != v]
        logging.warning("--config.algo.name=%s: the algo block is rebuilt from %s's defaults "
                        "(the config file's was %s's), then the command line's other algo "
                        "overrides; changed: %s", config.algo.name, config.algo.name, old,
                        ", ".join(changed) or "nothing")
    old = renamed("env.name")
    if old:
        kwargs = {}
        for k, v in overrides.items():
            if k == "env.kwargs":  # the whole block given as a dict
                kwargs.update(v.items())
            elif k.startswith("env.kwargs."):
                kwargs[k[len("env.kwargs."):]] = v
        config_lib.set_env(config, config.env.name, **kwargs)
        logging.warning("--config.env.name=%s: env.kwargs are rebuilt from %s's kwargs and "
                        "their defaults (the config file's were %s's), then the command line's "
                        "env.kwargs overrides: %s", config.env.name, config.env.name, old,
                        ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) or "none")
    if prepare:
        prepare(config)
    config_lib.check(config)
    return config


def one_line_errors(errors: tuple, fn, argv):
    """fn(argv); an exception in `errors` becomes one line on stderr and exit status 2."""
    try:
        return fn(argv)
    except errors as e:
        if os.environ.get(DEBUG_ENV) == "1":
            raise
        print(f"error: {error_message(e)}  ({DEBUG_ENV}=1 shows the traceback)", file=sys.stderr)
        # A failed checkpoint write leaves orbax's async write coroutines unawaited; their
        # RuntimeWarning at interpreter exit would print after the one line, which must stay
        # the last (seen once in CI after a full disk).
        warnings.filterwarnings("ignore", message="coroutine .* was never awaited",
                                category=RuntimeWarning)
        sys.exit(2)


def error_message(e: BaseException) -> str:
    # ml_collections raises AttributeError(KeyError("'key'\nDid you mean ...")) for an unknown
    # key: the KeyError's text, naming the override it came from.
    while e.args and isinstance(e.args[0], BaseException):
        e = e.args[0]
    if isinstance(e, KeyError) and e.args:
        key, _, hint = str(e.args[0]).partition("\n")
        key = key.strip("'\"")
        given = [a.split("=", 1)[0] for a in sys.argv if a.startswith("--config.")
                 and key in a.split("=", 1)[0].split(".")]
        where = given[0] if given else key
        parts = [f"{where}: no such config key {key!r}.", hint]
        if where.startswith("--config.env.kwargs."):
            parts.append(_env_kwargs_of_config_file())
        return " ".join(p for p in parts if p)
    config_file = _config_arg().split(":", 1)[0]
    if isinstance(e, OSError) and config_file and not os.path.isfile(config_file):
        return f"--config={config_file}: no such config file"
    text = str(e)
    # A config file's own exception reaches us inside absl's flag error, its traceback as text:
    # keep absl's prefix (the flag) and the exception's last line.
    if "Traceback (most recent call last)" in text:
        lines = text.splitlines()
        text = f"{lines[0].split(':', 1)[0]}: {lines[-1]}"
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _config_arg(argv=None) -> str:
    """The --config value on the command line (`configs/X.py[:variant]`)."""
    argv = sys.argv if argv is None else argv
    for at, arg in enumerate(argv):
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
        if arg == "--config" and at + 1 < len(argv):
            return argv[at + 1]
    return ""


def _env_kwargs_of_config_file() -> str:
    """Which env the config file sets and the kwargs it takes (its config is not at hand when
    an override fails, so the file is read again)."""
    from rl_tpu.recipes.variants import load_config_file

    path, *variant = _config_arg().split(":", 1)
    config = load_config_file(path).get_config(*variant)
    return (f"The config file's env {config.env.name!r} takes: "
            f"{', '.join(config.env.kwargs) or '(no kwargs)'}")
