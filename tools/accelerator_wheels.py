"""Wheels for a TPU or GPU machine without network: Dew and everything `dew-ml[EXTRAS]` needs there.

    python tools/accelerator_wheels.py --extras tpu,test --python 3.11 --out wheels

Run on a machine with network (PyPI), from the repository root; then, on the accelerator's machine:

    python3 -m pip install --no-index --find-links wheels 'dew-ml[tpu,test]'

Three steps: Dew's own wheel without its native CPU kernels (`DEW_NATIVE=0`: pure Python, so it installs on any
platform); wheels built here for the dependencies PyPI has only as source (lm-eval's rouge-score, say), which must
come out pure Python; then pip's download of the whole set for the target's Python and Linux x86-64 platform tags,
binary wheels only, with the two folders above as a source.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The Linux x86-64 tags a target with glibc 2.31 or newer takes (libtpu's wheels are manylinux_2_31).
PLATFORMS = ("manylinux_2_36_x86_64", "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, cwd=ROOT, env=env)


def source_only(extras: str) -> list[str]:
    """`name==version` of each dependency of `.[extras]` that pip would take as a source archive here."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        pip("install", "--quiet", "--dry-run", "--ignore-installed", "--report", str(report), f".[{extras}]")
        install = json.loads(report.read_text())["install"]
    return [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in install
            if not item["download_info"]["url"].endswith(".whl") and item["metadata"]["name"] != "dew-ml"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extras", default="tpu,test", help="dew-ml's extras to bring (tpu, cuda or cuda13, test)")
    parser.add_argument("--python", default="3.11", help="the target's Python, major.minor")
    parser.add_argument("--out", type=Path, default=ROOT / "wheels")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(out), ".", env={**os.environ, "DEW_NATIVE": "0"})
    sources = source_only(args.extras)
    if sources:
        with tempfile.TemporaryDirectory() as scratch:
            pip("wheel", "--quiet", "--no-deps", "--wheel-dir", scratch, *sources)
            for wheel in Path(scratch).glob("*.whl"):
                if not wheel.name.endswith("-none-any.whl"):
                    raise SystemExit(f"{wheel.name} built for this machine's platform, not only the target's: build "
                                     "it on a machine like the target and add it to the wheels")
                os.replace(wheel, out / wheel.name)
    platforms = [flag for tag in PLATFORMS for flag in ("--platform", tag)]
    pip("download", "--quiet", "--only-binary=:all:", "--python-version", args.python, "--implementation", "cp",
        *platforms, "--find-links", str(out), "--dest", str(out), f"dew-ml[{args.extras}]=={version}")
    wheels = sorted(out.glob("*.whl"))
    size = sum(wheel.stat().st_size for wheel in wheels)
    print(f"wrote {len(wheels)} wheels ({size / 2**20:.0f} MiB) to {out}: on the target, "
          f"python3 -m pip install --no-index --find-links {out.name} 'dew-ml[{args.extras}]'")


if __name__ == "__main__":
    main()
