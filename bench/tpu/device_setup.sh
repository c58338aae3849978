# Source from the repo root on a TPU machine that has the pinned wheels in .whl-tpu/
# (docs/performance.md; `pip download` them on a networked machine for the TPU host's Python 3.11:
# the device machine has no network) and the
# MaxText peer folder in .peers/maxtext-tpu/ (for grain, array_record and portpicker): installs
# jaxjob's dependencies under /tmp (kept while the machine is), appends them to PYTHONPATH after
# the machine's own JAX, and defines `rt` = the runtime CLI in-process.
if [ ! -f /tmp/site/.done ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-tpu/*.whl .peers/maxtext-tpu/wheels/grain-*.whl .peers/maxtext-tpu/wheels/array_record-*.whl .peers/maxtext-tpu/wheels/portpicker-*.whl || return 1
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --no-deps --no-compile --target /tmp/site2 pyarrow matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing python-dateutil six tensorstore==0.1.85 uvloop==0.23.0 || return 1
  touch /tmp/site/.done
fi
export PYTHONPATH=$PYTHONPATH:/tmp/site:/tmp/site2:$PWD PYTHONUNBUFFERED=1
rt() { python3 -c 'from runtime.commands.cli import main; main()' "$@"; }
