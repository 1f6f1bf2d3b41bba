"""`python3 -m launcher_scripts status|logs|cancel RUN_DIR`, `serve EXPORT_DIR`, `install-triton`,
`merge-lora BASE PEFT OUT`,
or overrides to launch, as main.py."""

import sys

OPERATIONS = ("status", "logs", "cancel")

if __name__ == "__main__":
    command = sys.argv[1] if sys.argv[1:2] else ""
    if command in OPERATIONS:
        from launcher_scripts.ops import main
    elif command == "serve":
        from launcher_scripts.jobs.export.serve import main

        sys.argv.pop(1)
    elif command == "merge-lora":
        from launcher_scripts.jobs.fine_tuning.merge_lora import main

        sys.argv.pop(1)
    elif command == "install-triton":
        from launcher_scripts.jobs.export.install import main

        sys.argv.pop(1)
    else:
        from launcher_scripts.main import main
    sys.exit(main())
