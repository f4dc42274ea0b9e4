#!/usr/bin/env python3
"""Peak memory of loading a decompression bomb vs a good file (issue 19, item 3).

Writes, in a temporary directory:

* **good**: ``compileAndExport`` of a 64-32-10 MLP;
* **bomb**: a copy of it whose ``constants.safetensors`` blob is 512 MiB of zeros stored
  *deflated* (about 0.5 MB on disk), with a manifest and checksums that match;

then, side by side, each in a fresh process (after ``import torch, poptorch`` and
torch's deserializer), ``poptorch.load(file)`` and reports the resident set size before
the load and its peak during the load (Linux: ``VmRSS``, and ``VmHWM`` after resetting
it through ``/proc/self/clear_refs``), and what the load raised.

Usage::

    python bench/file_limits.py
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, _ROOT)

_CHILD = r'''
import sys, time
import torch, poptorch
import torch._export.serde.serialize  # the deserializer's imports are not measured

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key + ":"))

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
before = status("VmRSS")
start = time.perf_counter()
try:
    poptorch.load(sys.argv[1])
    outcome = "loaded"
except Exception as exc:  # noqa: BLE001
    outcome = f"{type(exc).__name__}: {str(exc).split(': ', 2)[-1][:90]}"
print(before, status("VmHWM"), time.perf_counter() - start, outcome, sep="\t")
'''


def _good(path):
    import torch
    import poptorch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    poptorch.inferenceModel(model, poptorch.Options().showCompilationProgressBar(
        False)).compileAndExport(path, torch.randn(8, 64))


def _bomb(good, path, mebibytes=512):
    """``good`` with its constants blob replaced by ``mebibytes`` MiB of zeros,
    deflated; manifest sizes and checksums consistent."""
    with zipfile.ZipFile(good) as archive:
        blobs = {n: archive.read(n) for n in archive.namelist() if n != "manifest.json"}
    chunk = bytes(1 << 20)
    digest = hashlib.sha256()
    for _ in range(mebibytes):
        digest.update(chunk)
    entries = {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)}
               for n, d in blobs.items()}
    entries["constants.safetensors"] = {"sha256": digest.hexdigest(),
                                        "size": mebibytes << 20}
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("manifest.json", json.dumps(
            {"format": "poptorch-executable", "format_version": 1, "blobs": entries}))
        for name, data in blobs.items():
            if name != "constants.safetensors":
                archive.writestr(name, data)
        info = zipfile.ZipInfo("constants.safetensors")
        info.compress_type = zipfile.ZIP_DEFLATED
        with archive.open(info, "w", force_zip64=True) as stream:
            for _ in range(mebibytes):
                stream.write(chunk)


def main():
    with tempfile.TemporaryDirectory() as tmp:
        good, bomb = os.path.join(tmp, "good.poptorch"), os.path.join(tmp, "bomb.poptorch")
        _good(good)
        _bomb(good, bomb)
        print("| file | size on disk | RSS before load (MiB) | peak during load (MiB) | "
              "growth (MiB) | load (s) | outcome |")
        print("|---|---|---|---|---|---|---|")
        for name, path in (("good", good), ("bomb", bomb)):
            out = subprocess.run([sys.executable, "-c", _CHILD, path], cwd=_ROOT,
                                 check=True, capture_output=True, text=True)
            before, after, seconds, outcome = out.stdout.strip().splitlines()[-1].split(
                "\t")
            before, after = int(before) / 1024, int(after) / 1024
            print(f"| {name} | {os.path.getsize(path) / 1e6:.2f} MB | {before:.1f} | "
                  f"{after:.1f} | {after - before:.1f} | {float(seconds):.2f} | "
                  f"{outcome} |")


if __name__ == "__main__":
    main()
