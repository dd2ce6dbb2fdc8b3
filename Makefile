# The two commands of the quick start: `make demo` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.dtrain-installed

.PHONY: demo test test-slow test-gpu test-all soak install-launchers bench lint clean

$(PY):
	python3 -m venv $(VENV)

# torch is pinned here (a CPU build is available locally); the package itself asks for torch>=2.4.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install -qq "torch==2.13.0"
	$(PY) -m pip install -qq -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dtrain train

# Two workers (pytest-xdist), each taking whole files: the quick suite leaves a core idle
# about 40% of the time when run alone (interpreter starts, rendezvous, sleeps).
XDIST := -n 2 --dist loadfile

test: $(STAMP)
	$(PY) -m pytest -q $(XDIST)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(XDIST)

# The soak drills at their full counts (test-slow runs a few rounds of each, tests/support/soak.py):
# a host crashed and rejoined 20 times in a row, 20 whole hosts of a live job lost in turn,
# the etcd leader killed 10 times, 50 SIGKILLs at random moments of blocking saves, 50 of
# background saves and 50 of replicated saves (checkpoint.copies), 100 clean exits of the
# pipeline example, 20 parameter servers killed in turn and replaced. The host drills need
# root (network namespaces), the etcd ones etcd-server.
SOAK := tests/launch/test_multihost.py::test_a_host_restarted_after_a_crash_rejoins_and_resumes \
	tests/ft/test_host_loss.py::test_losing_any_host_rank_0s_first_loses_no_step \
	tests/store/test_etcd.py::test_killing_the_etcd_leader_mid_run_loses_no_step \
	tests/faults/test_faults.py::test_sigkill_at_random_moments_of_saving_never_loses_the_newest_checkpoint \
	tests/checkpoint/test_background_save.py::test_sigkill_at_random_moments_of_background_saving_never_loses_the_newest \
	tests/checkpoint/test_checkpoint_copies.py::test_sigkill_at_random_moments_of_replicated_saving_never_loses_the_newest \
	tests/launch/test_exit.py::test_pipeline_example_exits_cleanly_every_time_with_native_collectives \
	tests/ps/test_replacement.py::test_servers_killed_in_turn_are_replaced_every_time

soak: $(STAMP)
	DTRAIN_SOAK_ROUNDS=full $(PY) -m pytest -q -m '' $(SOAK)

# The CUDA lane (NCCL, CUDA tensors, bf16, split-form construction on the GPU): on a
# machine with a GPU; skipped cleanly elsewhere.
test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

# Everything: the quick suite, then the slow tests (what CI runs).
test-all: test test-slow

# Open MPI, SLURM and munge, for the real-launcher tests (tests/launch/test_real_launchers.py,
# slow), and etcd for the replicated store's (tests/store/test_etcd.py); each skips, saying why,
# without them: Debian or Ubuntu, as root.
install-launchers:
	apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openmpi-bin slurm-wlm munge etcd-server

bench: $(STAMP)
	$(VENV)/bin/dtrain run -n 2 benchmarks/dp_vs_ddp.py

# ruff, then mypy (its configuration, strict packages and baseline: pyproject.toml [tool.mypy])
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache
