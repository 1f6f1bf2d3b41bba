#!/usr/bin/env python3
"""Entry point: python3 main.py stages=[data_preparation,training] training=gpt3/126m ..."""

import sys

from launcher_scripts.main import main

if __name__ == "__main__":
    sys.exit(main())
