"""`python3 -m launcher_scripts status|logs|cancel RUN_DIR`, or overrides to launch, as main.py."""

import sys

OPERATIONS = ("status", "logs", "cancel")

if __name__ == "__main__":
    if sys.argv[1:2] and sys.argv[1] in OPERATIONS:
        from launcher_scripts.ops import main
    else:
        from launcher_scripts.main import main
    sys.exit(main())
