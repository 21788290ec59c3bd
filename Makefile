# The course in two commands:  `make course`  (set up + run every notebook headless)
#                              `make test`    (set up + the test tools + run the test suite; .ci/run calls it)
# QUICK=1 shrinks every run so the whole course finishes in minutes on a 2-core CPU.
# TORCH=cpu (Linux without an NVIDIA GPU): PyTorch's CPU-only build from TORCH_CPU_INDEX instead of PyPI's
# CUDA build; where that index cannot be reached, one line says so and the default build is installed.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
QUICK  ?= 0
TORCH  ?= default
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
export COURSE_QUICK := $(QUICK)

.PHONY: setup data course test bench soak lab gpu-check clean doctor-wheel

setup: $(VENV)/.installed

# Rebuilt only when the pins change (one stamp per requirements file: `make test` after `make course`
# installs only the test tools). The kernelspec inside the venv makes notebooks run on this venv's Python
# even if another "python3" kernel is installed on the machine.
$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -I scripts/course/setup_torch.py --torch $(TORCH) --index $(TORCH_CPU_INDEX)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (course)" >/dev/null
	$(VENV)/bin/jupyter labextension disable --level=sys_prefix "@jupyterlab/apputils-extension:announcements" >/dev/null 2>&1 || true
	touch $@

data: setup
	$(PY) -m course.datagen

# Headless, each "Check yourself" is answered from its key (scripts/course/answer_key/); in JupyterLab they start empty.
course: data
	COURSE_ANSWER_KEY=1 $(PY) -m course.run_notebooks

# The test tools (pytest, playwright, ruff): only for `make test`.
$(VENV)/.installed-test: requirements-test.txt | $(VENV)/.installed
	$(PIP) -r requirements-test.txt
	touch $@

test: data $(VENV)/.installed-test
	$(PY) -m pytest --durations=15

# Speed goals are measured here, not in timed tests: rounds and verdict in runs/benchmarks/*/metrics.json.
bench: data
	$(PY) -m course.bench_launcher
	$(PY) -m course.bench_noise
	$(PY) -m course.bench_checker
	$(PY) -m course.bench_doctor
	$(PY) -m course.bench_doctor_public
	$(PY) -m course.bench_report

# The quick course 3 times, each in a fresh clone of HEAD, the last beside a busy core (issue 51); about an hour
# on 2 cores. Figures: runs/soak/metrics.json.
soak: data
	$(PY) -m course.soak

# On a machine with CUDA GPUs: the GPU paths + every notebook (quick), report in runs/gpu_check/.
gpu-check: data
	$(PY) -m course.gpu_check

# The DDP doctor to take home: a wheel (build/dist/) holding the ddp_doctor package alone, torch its only
# requirement; installed into any environment, it gives the `ddp-doctor` command (tests/test_doctor_install.py
# installs one into a bare venv).
doctor-wheel: setup
	$(PY) -m course.doctor_wheel build/dist

lab: data
	$(PY) -m course.lab

clean:
	rm -rf build runs/*/ weights/*.pt
