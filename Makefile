# The two front-door commands (README): `make demo` and `make test`. Both bootstrap first (idempotent).
# `make test` runs the unit and integration suites (pytest 4:17-5:30 on a 2-core AMD EPYC with AVX-512 + AVX512-BF16,
# against its 5-minute budget: the integration tests' engines start during the unit tests); `make test-slow` the slow
# suite (tests/slow: the fault suite, insider faults, stream migration, the KV tier's meshes and its disk tier, one
# real-vLLM node, the live plan and platform meshes, a hung engine core; 11:53-13:43 on the same host since a
# simulated node no longer imports vLLM to start, against a 15-minute budget: a new real-engine test shares an
# engine).
# CI (.ci/run) runs both.
PY := .venv/bin/python

.PHONY: bootstrap demo test test-slow test-unit test-integration lint protos bench

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	$(PY) scripts/demo.py

test: bootstrap
	$(PY) -m ruff check p2pnode scripts tests
	$(PY) scripts/gen_protos.py --check
	$(PY) -m pytest -q

test-slow: bootstrap
	$(PY) -m pytest -q tests/slow

test-unit: bootstrap
	$(PY) -m pytest -q tests/unit

test-integration: bootstrap
	$(PY) -m pytest -q tests/integration

# The tree is formatted by hand (tables and aligned literals, ``# fmt: skip`` where ruff's formatter would undo
# them), so lint checks what ruff's linter finds and that the generated protobuf modules are current.
lint: bootstrap
	$(PY) -m ruff check p2pnode scripts tests
	$(PY) scripts/gen_protos.py --check

protos:
	$(PY) scripts/gen_protos.py

bench: bootstrap
	$(PY) scripts/bench_index.py
