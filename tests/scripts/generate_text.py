"""In-process generation on a portable model (any family), for comparison with served results:

python -m tests.scripts.generate_text MODEL.nemo PROMPTS_JSON TOKENS [key=value ...]
prints a JSON list of completions (text).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launcher_scripts.jobs.inference.generation import GenerationParams, generate
from launcher_scripts.jobs.inference.runner import close_runner
from launcher_scripts.jobs.inference.served import open_served


def main() -> None:
    model_file, prompts_file, tokens = sys.argv[1:4]
    overrides = dict(arg.split("=", 1) for arg in sys.argv[4:])
    params = GenerationParams(
        tokens_to_generate=int(tokens),
        top_k=int(overrides.get("top_k", 1)),
        beam_width=int(overrides.get("beam_width", 1)),
    )
    served = open_served(Path(model_file))
    prompts = json.loads(Path(prompts_file).read_text())
    completions = generate(
        served.decoding, served.tokenizer, prompts, params, max_length=served.max_length
    )
    close_runner()
    print(json.dumps([c.text for c in completions]))


if __name__ == "__main__":
    main()
