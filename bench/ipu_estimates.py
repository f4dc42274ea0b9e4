"""The IPU Model's estimates of Graphcore's published configurations, side by side
with the published figures (``bench/calibration.py``).

For every case: the configuration, the published fit / no-fit verdict, ours with the
MB needed on each IPU of a replica (``*`` marks an IPU that does not fit), the
published throughput, ours and their ratio, and how long building, capturing,
compiling and estimating took. Three groups: the calibration set, physically
impossible configurations (must not fit) and held-out published configurations the
model was not calibrated on; then the validation set of other model families
(``bench/validation.py``), whose published throughput is compared with ours as the
source measured it (the device's run, or a Python loop of calls with its host time).
The models are built on the ``meta`` device: estimates
come from shapes, no kernel runs at full size.

Run from the repository root: ``python bench/ipu_estimates.py [--only NAME,...]
[--report DIR] [--calibration-only]`` (``--report`` also writes the profile report of
BERT-Large phase 1 with gradient accumulation 16 into ``DIR``: the README's
screenshot).
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
import validation  # noqa: E402


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


def _summary(title: str, ratios) -> None:
    if not ratios:
        return
    mean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    inside = sum(0.8 <= r <= 1.25 for r in ratios)
    high = sum(r > 1 for r in ratios)
    print(f"{title}: {len(ratios)} published throughputs, geometric mean {mean:.2f}, "
          f"{inside} within 0.8-1.25x, {high} high / {len(ratios) - high} low, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}")


def _validation(checks) -> None:
    """The validation set's table: verdicts, MB per IPU, and the published throughput
    against ours as the source measured it (device, loop of calls, loop with loader)."""
    print(f"\nValidation set (bench/validation.py; * fitted, + seen, the rest held out)\n"
          f"{'configuration':<22} {'family':<12} {'pub':>7} {'ours':>7} {'':>5}  "
          f"{'ours: MB per IPU (* = over)':<40} {'pub/s':>8} {'how':>11} "
          f"{'device/s':>9} {'loop/s':>9} {'ratio':>6} {'time s':>6}")
    right, held, fitted, seen = 0, [], [], []
    for case in checks:
        est, seconds = calibration.estimate(case)
        device = est["cycles"]["samples_per_second"]
        loop = validation.loop_throughput(est, case.loader, case.host_processes)
        ours = device if case.measured == "device" else loop
        mem = " ".join(f"{m['total'] / 1e6:,.0f}{'' if m['fits'] else '*'}"
                       for m in est["memory"])
        ok = est["fits"] == case.fits
        right += ok
        ratio = ours / case.throughput if case.throughput else None
        if ratio:
            (fitted if case.fitted else seen if case.seen else held).append(ratio)
        name = case.name + ("*" if case.fitted else "+" if case.seen else "")
        print(f"{name:<22} {case.family:<12} {_verdict(case.fits):>7} "
              f"{_verdict(est['fits']):>7} {'ok' if ok else 'WRONG':>5}  {mem:<40} "
              f"{(f'{case.throughput:,.0f}' if case.throughput else '-'):>8} "
              f"{case.measured:>11} {device:>9,.0f} {loop:>9,.0f} "
              f"{(f'{ratio:.2f}' if ratio else '-'):>6} {seconds:>6.1f}", flush=True)
    for case in checks:
        print(f"  {case.name}: {case.description}; published: {case.source}")
    print(f"\nValidation verdicts: {right} of {len(checks)} right, "
          f"{len({c.family for c in checks})} families")
    _summary("Held out", held)
    _summary("Seen while choosing COMPUTE_SET_CYCLES", seen)
    _summary("Fitted", fitted)
    _summary("All", held + seen + fitted)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--report", default="", help="write BERT-Large's profile report")
    parser.add_argument("--calibration-only", action="store_true",
                        help="skip the validation set (bench/validation.py)")
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
    checks = [c for c in validation.CHECKS if not only or c.name in only]
    if checks and not args.calibration_only:
        _validation(checks)
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
