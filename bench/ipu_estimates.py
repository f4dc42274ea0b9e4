"""The IPU Model's estimates of Graphcore's published configurations, side by side
with the published figures (``bench/calibration.py``).

For every case: the configuration, the published fit / no-fit verdict, ours with the
MB needed on each IPU of a replica (``*`` marks an IPU that does not fit), the
published throughput, ours and their ratio, and how long building, capturing,
compiling and estimating took. Three groups: the calibration set, physically
impossible configurations (must not fit) and held-out published configurations the
model was not calibrated on. The models are built on the ``meta`` device: estimates
come from shapes, no kernel runs at full size.

Run from the repository root: ``python bench/ipu_estimates.py [--only NAME,...]
[--report DIR]`` (``--report`` also writes the profile report of BERT-Large phase 1
with gradient accumulation 16 into ``DIR``: the README's screenshot).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import calibration  # noqa: E402


def _verdict(fits: bool) -> str:
    return "fits" if fits else "no fit"


def _row(case, est, seconds) -> str:
    mem = " ".join(f"{m['total'] / 1e6:,.0f}{'' if m['fits'] else '*'}"
                   for m in est["memory"])
    ours = est["cycles"]["samples_per_second"]
    published = f"{case.throughput:,.0f}" if case.throughput else "-"
    ratio = f"{ours / case.throughput:.2f}" if case.throughput else "-"
    ok = "ok" if est["fits"] == case.fits else "WRONG"
    return (f"{case.name:<22} {_verdict(case.fits):>7} {_verdict(est['fits']):>7} {ok:>5}  "
            f"{mem:<48} {published:>9} {ours:>9,.0f} {ratio:>6} {seconds:>6.1f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--report", default="", help="write BERT-Large's profile report")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    import poptorch
    poptorch.setLogLevel("ERR")  # the impossible cases' out-of-memory warnings
    only = {n for n in args.only.split(",") if n}
    header = (f"{'configuration':<22} {'pub':>7} {'ours':>7} {'':>5}  "
              f"{'ours: MB per IPU (* = over)':<48} {'pub/s':>9} {'ours/s':>9} "
              f"{'ratio':>6} {'time s':>6}")
    ratios = []
    for title, cases in (("Calibration set", calibration.CALIBRATION),
                         ("Physically impossible (must not fit)", calibration.IMPOSSIBLE),
                         ("Held out (not calibrated on)", calibration.HELD_OUT)):
        chosen = [c for c in cases if not only or c.name in only]
        if not chosen:
            continue
        print(f"\n{title}\n{header}")
        for case in chosen:
            est, seconds = calibration.estimate(case)
            print(_row(case, est, seconds), flush=True)
            if case.throughput and cases is calibration.CALIBRATION:
                ratios.append(est["cycles"]["samples_per_second"] / case.throughput)
        for case in chosen:
            print(f"  {case.name}: {case.description}; published: {case.source}")
    if ratios:
        mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        worst = max(ratios, key=lambda r: abs(math.log(r)))
        print(f"\nCalibration throughput ratios: geometric mean {mean:.2f}, worst {worst:.2f}")
    if args.report:
        model, opts, optimizer, inputs = calibration.CASES["bert-large-ph1"].build()
        # gradient accumulation 16 keeps the timeline's ramp-up and ramp-down readable
        opts.enableProfiling(args.report).modelName("bert-large")
        opts.Training.gradientAccumulation(16)
        inputs = tuple(t[:8 * 16 * 4] for t in inputs)
        wrapper = poptorch.trainingModel(model, opts, optimizer)
        wrapper.compile(*inputs)
        print(f"\nprofile report: {os.path.join(args.report, 'bert-large')}")


if __name__ == "__main__":
    main()
