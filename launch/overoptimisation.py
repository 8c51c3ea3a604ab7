"""Reward over-optimisation curves: `python -m launch.overoptimisation --runs NAME=W ... --out F`.

Gold and proxy reward against KL(pi || pi_0) for RL runs trained against a reward model with
`--config.algo.log_kl=true` (rl_tpu/rewards/overoptimisation.py): prints a markdown table of
each run's windows and gold peak, and saves the figure to --out. Point it at any runs: the
keys it reads are flags (--gold eval/success, for instance).
"""

from absl import app, flags

from rl_tpu.rewards import overoptimisation as oo

flags.DEFINE_multi_string("runs", [], "NAME=WORKDIR, one per run (e.g. kl0.1=/tmp/oo_kl01).")
flags.DEFINE_string("out", "", "Where to save the figure (.png); '' = the table only.")
flags.DEFINE_integer("windows", 10, "Windows of equal length the steps are averaged in.")
flags.DEFINE_string("kl", oo.KL, "The KL metric (x axis).")
flags.DEFINE_string("proxy", oo.PROXY, "The proxy reward metric (what the policy was paid).")
flags.DEFINE_string("gold", oo.GOLD, "The gold reward metric (what the proxy stands in for).")
flags.DEFINE_string("title", "", "The figure's title.")


def main(argv):
    del argv
    f = flags.FLAGS
    if not f.runs:
        raise app.UsageError("give at least one --runs NAME=WORKDIR")
    curves = []
    for spec in f.runs:
        name, sep, workdir = spec.partition("=")
        if not sep or not name or not workdir:
            raise app.UsageError(f"--runs {spec!r}: expected NAME=WORKDIR")
        curves.append(oo.read_curve(name, workdir, f.windows, f.kl, f.proxy, f.gold))
    print("\n".join(oo.table(curves)))
    if f.out:
        oo.plot(curves, f.out, f.title or None)
        print(f"figure: {f.out}")


if __name__ == "__main__":
    app.run(main)
