#!/usr/bin/env bash
# Fills .whl/ (git-ignored, at the repo root) with the Python 3.12 wheels the GPU check machine
# lacks (docs: /work/shared/GPU-CHECKS.md; issue 38). That machine: Linux x86_64, Python 3.12,
# torch 2.11 + CUDA 13, transformers, sentencepiece, safetensors, pytest; no network. What travels
# there (the checkout's files and the wheels together) may total at most 64 MiB: the wheels get what
# the checkout leaves, less a margin.
#
# Every wheel is fetched with --no-deps from the explicit lists below: the dependency closure was
# worked out once (pip show / importlib.metadata requires on Python 3.12 markers) and is written
# here, so pip can never pull torch, nvidia-* or triton (GBs, and on the machine already).
# Versions are the ones the CPU test environment runs. Change a pin: re-check its requirements.
#
# On the machine there, offline (run.sh does this):
#   pip install --no-index --find-links .whl -r .whl/requirements.txt
#   pip install --no-index --find-links .whl --no-deps -r .whl/alone.txt
# run.sh uses the launcher from the checkout (no launcher wheel is built: it would be stale).
#
# Usage: bench/gpu/fetch-wheels.sh    (re-runnable: .whl/ is emptied first)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="$ROOT/.whl"
TRAVEL=$((64 * 1024 * 1024))  # bytes: all that travels to the machine, 64 MiB
MARGIN=$((1024 * 1024))       # for files added to the checkout after the wheels are fetched
checkout=$(cd "$ROOT" && git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
BUDGET=$((TRAVEL - checkout - MARGIN))

# On the GPU machine already (not fetched), as the device tool's KINDS.md lists its packages (read
# 2026-11-17), where the launcher or lm-eval's evaluator needs them: torch and what it pulls,
# transformers and what it pulls, and the scientific stack.
ON_MACHINE=(
    torch
    transformers
    tokenizers
    huggingface-hub
    numpy
    pyyaml
    tqdm
    packaging
    typing-extensions
    fsspec
    click
    pygments
    sentencepiece
    safetensors
    pytest
    setuptools
    jinja2
    markupsafe
    matplotlib
    tensorboard
    pandas
    pyarrow
    scikit-learn
    sacrebleu
    requests
    xxhash
    aiohttp
    absl-py
    joblib
    regex
    six
)

# Always fetched: the launcher's runtime requirements the machine lacks, megatron-core, and their
# dependency closure (each line: the wheel, then why it is here).
WHEELS=(
    "hydra-core==1.3.8"            # requirements.txt: recipes are composed with Hydra
    "omegaconf==2.3.1"             # requirements.txt; hydra-core's config objects
    "orjson==3.13.0"               # requirements.txt: JSON of plans and metrics
    "zstandard==0.25.0"            # requirements.txt: compressed corpora
    "gigatoken==0.10.0"            # requirements.txt: the tokenizing data preparation
    "awkward==2.14.0"              # gigatoken's batches
    "awkward-cpp==57"              # awkward's compiled part (pinned by awkward 2.14.0)
    "typer==0.29.2"                # gigatoken's CLI
    "pydantic==2.13.4"             # typer >= 0.2x needs it
    "pydantic-core==2.46.4"        # pinned by pydantic 2.13.4
    "annotated-types==0.7.0"       # pydantic
    "typing-inspection==0.4.2"     # pydantic
    "annotated-doc==0.0.7"         # typer
    "rich==15.0.0"                 # typer
    "markdown-it-py==4.3.0"        # rich
    "mdurl==0.1.2"                 # markdown-it-py
    "shellingham==1.5.4"           # typer
    "megatron-core==0.16.1"        # [train]: the training, conversion and evaluation jobs
    "psutil==7.2.2"                # [train]: megatron-core's checkpoint writer
    "pytest-xdist==3.8.0"          # [dev]: pyproject's pytest addopts run -n 2
    "execnet==2.1.2"               # pytest-xdist
)
# typer, rich, psutil and pytest-xdist are on the machine too, at versions not known here: their
# wheels are small, and pip keeps what is installed where it satisfies the requirement.
# Only an sdist on PyPI (hydra-core 1.3 needs ==4.9.*): built here into a pure-Python wheel.
SDIST_WHEELS=(
    "antlr4-python3-runtime==4.9.3"  # hydra-core's and omegaconf's grammar runtime
    "rouge-score==0.1.2"             # lm-eval (installed alone, like its group below)
    "sqlitedict==2.1.0"              # lm-eval
    "word2number==1.1"               # lm-eval
)

# Fetched, group by group in this order (the most useful first), only while the total stays
# within the budget. A group is one line: "name: wheel wheel ...".
OPTIONAL_GROUPS=(
    "lm-eval: lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 pytablewriter==1.2.1 dataproperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1 nltk==3.10.4 defusedxml==0.7.1 more-itertools==11.2.1"
)

# Installed with --no-deps there (lm-eval and what it needs beyond the machine's packages): the
# machine's own versions of pyarrow, pandas and fsspec are kept, whatever datasets' pins say, and
# an offline resolver cannot fail on a pin. Where they do not import, the evaluation step still
# checks the evaluation job's model adapter (lm_eval.api needs only jinja2, numpy, pyyaml, requests).
INSTALL_ALONE=(
    lm-eval datasets evaluate dill multiprocess pytablewriter dataproperty mbstrdecoder
    pathvalidate tabledata tcolorpy typepy chardet nltk defusedxml more-itertools
    rouge-score sqlitedict word2number
)

# Not fetched: larger than the budget (each with what it leaves unchecked on the GPU machine).
LEFT_OUT=(
    "transformer-engine: the TE layer spec and FP8 (CUDA wheels of hundreds of MiB)"
    "wandb: W&B logging (~20 MiB wheel plus protobuf, sentry-sdk, gitpython; optional, no network there anyway)"
    "triton: the Triton inference server (not a wheel; the serving checks use the launcher's own server)"
)

PIP_TARGET=(
    --only-binary=:all: --no-deps
    --python-version 3.12 --implementation cp --abi cp312
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform any
    --disable-pip-version-check --quiet
)

total_bytes() {
    local dir=$1 sum=0 f
    for f in "$dir"/*.whl; do
        [[ -e $f ]] || continue
        sum=$((sum + $(stat -c %s "$f")))
    done
    echo "$sum"
}

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

rm -rf "$DEST"
mkdir -p "$DEST"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "fetching ${#WHEELS[@]} wheels into $DEST"
python3 -m pip download "${PIP_TARGET[@]}" -d "$DEST" "${WHEELS[@]}"
echo "building ${#SDIST_WHEELS[@]} wheel(s) from sdist"
python3 -m pip wheel --no-deps --no-binary=:all: --disable-pip-version-check --quiet \
    -w "$DEST" "${SDIST_WHEELS[@]}"

kept=()
skipped=()
for group in "${OPTIONAL_GROUPS[@]}"; do
    name="${group%%:*}"
    read -r -a specs <<<"${group#*:}"
    rm -rf "$work/g" && mkdir -p "$work/g"
    python3 -m pip download "${PIP_TARGET[@]}" -d "$work/g" "${specs[@]}"
    # Wheels of the group already fetched (pillow, for tensorboard) count once.
    for f in "$work/g"/*.whl; do
        [[ -e "$DEST/$(basename "$f")" ]] && rm -f "$f"
    done
    size=$(total_bytes "$work/g")
    now=$(total_bytes "$DEST")
    if ((now + size <= BUDGET)); then
        mv "$work/g"/*.whl "$DEST"/ 2>/dev/null || true
        kept+=("$name ($(mib "$size"))")
    else
        skipped+=("$name ($(mib "$size")): does not fit ($(mib "$now") already)")
    fi
done

total=$(total_bytes "$DEST")
{
    echo "# Wheels for the GPU check machine (Python 3.12, Linux x86_64), by bench/gpu/fetch-wheels.sh"
    echo "# Install there: pip install --no-index --find-links .whl -r .whl/requirements.txt"
    echo "#                pip install --no-index --find-links .whl --no-deps -r .whl/alone.txt"
    echo "# total: $total bytes ($(mib "$total")) of a $BUDGET-byte budget ($(mib "$TRAVEL") less the checkout's $(mib "$checkout") and a margin)"
    echo
    echo "## wheels"
    for f in "$DEST"/*.whl; do
        printf '%10d  %s\n' "$(stat -c %s "$f")" "$(basename "$f")"
    done
    echo
    echo "## optional groups kept"
    for k in "${kept[@]+"${kept[@]}"}"; do echo "$k"; done
    echo
    echo "## left out (fit budget); what they leave unchecked on the GPU machine"
    for s in "${skipped[@]+"${skipped[@]}"}"; do echo "$s"; done
    for s in "${LEFT_OUT[@]}"; do echo "$s"; done
    echo
    echo "## on the machine already (not fetched)"
    echo "${ON_MACHINE[*]}"
} >"$DEST/MANIFEST.txt"
# The top-level names to install there (pip resolves the rest from .whl/ and the machine), and
# those installed alone, without their declared dependencies.
alone=" $(printf '%s ' "${INSTALL_ALONE[@]}" | tr '[:upper:]_' '[:lower:]-')"
: >"$DEST/requirements.txt"
: >"$DEST/alone.txt"
for f in "$DEST"/*.whl; do
    base="$(basename "$f")"
    name="${base%%-*}"
    canonical="$(tr '[:upper:]_' '[:lower:]-' <<<"$name")"
    if [[ $alone == *" $canonical "* ]]; then
        echo "$name" >>"$DEST/alone.txt"
    else
        echo "$name" >>"$DEST/requirements.txt"
    fi
done

sed -n '/^## wheels/,/^$/p' "$DEST/MANIFEST.txt"
echo "left out:"
for s in "${skipped[@]+"${skipped[@]}"}" "${LEFT_OUT[@]}"; do echo "  $s"; done
echo "total: $total bytes ($(mib "$total")) in $DEST"
if ((total > BUDGET)); then
    echo "error: the wheels total $(mib "$total"), over the $(mib "$BUDGET") the checkout leaves of $(mib "$TRAVEL")" >&2
    exit 1
fi
