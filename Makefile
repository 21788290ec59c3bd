# The course in two commands:  `make course`  (set up + run every notebook headless)
#                              `make test`    (set up + run the test suite; .ci/run calls it)
# QUICK=1 shrinks every run so the whole course finishes in minutes on a 2-core CPU.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
QUICK  ?= 0
export COURSE_QUICK := $(QUICK)

.PHONY: setup data course test bench lab gpu-check clean

setup: $(VENV)/.installed

# Rebuilt only when the pins change. The kernelspec inside the venv makes notebooks run on this
# venv's Python even if another "python3" kernel is installed on the machine.
$(VENV)/.installed: requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (course)" >/dev/null
	$(VENV)/bin/jupyter labextension disable --level=sys_prefix "@jupyterlab/apputils-extension:announcements" >/dev/null 2>&1 || true
	touch $@

data: setup
	$(PY) -m course.datagen

# Headless, each "Check yourself" is answered from its key (scripts/course/answer_key/); in JupyterLab they start empty.
course: data
	COURSE_ANSWER_KEY=1 $(PY) -m course.run_notebooks

test: data
	$(PY) -m pytest --durations=15

# Speed goals are measured here, not in timed tests: rounds and verdict in runs/benchmarks/*/metrics.json.
bench: data
	$(PY) -m course.bench_launcher
	$(PY) -m course.bench_noise
	$(PY) -m course.bench_checker

# On a machine with CUDA GPUs: the GPU paths + every notebook (quick), report in runs/gpu_check/.
gpu-check: data
	$(PY) -m course.gpu_check

lab: data
	$(PY) -m course.lab

clean:
	rm -rf build runs/*/ weights/*.pt
