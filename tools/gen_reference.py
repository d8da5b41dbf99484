"""Write docs/reference.md: every Trainer setting and callback argument (meshtrain/settings/),
then the public Python API, each public module's ``__all__``, and the old paths of moved
modules (meshtrain/_public.py).

    python tools/gen_reference.py           write it
    python tools/gen_reference.py --check   exit 1 if it is stale (as tests/test_settings.py)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshtrain._public import reference_document  # noqa: E402

REFERENCE = ROOT / "docs" / "reference.md"


def main(argv: list[str]) -> int:
    text = reference_document()
    if "--check" in argv:
        if not REFERENCE.is_file() or REFERENCE.read_text() != text:
            print(f"{REFERENCE} is stale: run python tools/gen_reference.py", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
