"""Build eval/prompts/ood_python.jsonl: out-of-domain completion prompts (Python that is not the standard library).

    python scripts/build_ood_prompts.py          # rewrites eval/prompts/ood_python.jsonl (shipped; deterministic)

tiny-code was trained on the standard library only; these prompts come from permissively licensed pure-Python
packages installed with draftsmith's own dependencies. Each row: {"prompt", "category" (the package),
"source" (package version, file, line), "license"}. Taken: for every package, its .py files in sorted order,
the code around the third def/class of each file (8 lines before it, 40 from it), 8 prompts per package.
"""

from __future__ import annotations

import importlib.metadata as md
import json
from pathlib import Path

# package (import name, distribution) → SPDX license, as stated in the installed dist's metadata / LICENSE file
PACKAGES = {("hydra", "hydra-core"): "MIT", ("click", "click"): "BSD-3-Clause", ("filelock", "filelock"): "MIT",
            ("packaging", "packaging"): "Apache-2.0 OR BSD-2-Clause"}
PER_PACKAGE = 8
OUT = Path(__file__).resolve().parent.parent / "eval" / "prompts" / "ood_python.jsonl"


def prompts_of(module: str, dist: str, license_: str) -> list[dict]:
    root = Path(__import__(module).__file__).parent
    version = md.version(dist)
    rows = []
    for f in sorted(root.rglob("*.py")):
        if "test" in f.parts or "_vendor" in str(f):
            continue
        lines = f.read_text(encoding="utf-8").splitlines()
        defs = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        if len(defs) < 3:
            continue
        i = defs[2]
        text = "\n".join(lines[max(0, i - 8) : i + 40]) + "\n"
        if len(text) < 600:
            continue
        rows.append({"prompt": text, "category": module, "license": license_,
                     "source": f"{dist} {version} {f.relative_to(root.parent)}:{max(0, i - 8) + 1}"})
        if len(rows) == PER_PACKAGE:
            break
    return rows


def main() -> None:
    rows = [r for (mod, dist), lic in PACKAGES.items() for r in prompts_of(mod, dist, lic)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts to {OUT}")


if __name__ == "__main__":
    main()
