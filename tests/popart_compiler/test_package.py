"""The package's layering: ``popart_compiler`` never imports ``poptorch``."""
import subprocess
import sys


def test_package_does_not_import_poptorch():
    code = ("import sys, popart_compiler, popart_compiler.runtime.session, "
            "popart_compiler.compiler; assert 'poptorch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
