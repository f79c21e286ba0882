# Sourced by the reports' run.sh files on the device machine (run from the repository root): installs the carried
# wheels (WHL, default .whl) into /tmp/site, makes this tree's tangram importable (sitecustomize), exports
# PYTHONPATH, and writes the device's name and clocks to $R/device.txt (R default $OUT/r).
set -o pipefail
export PYTHONUNBUFFERED=1
ROOT=${ROOT:-$PWD}
WHL=${WHL:-$ROOT/.whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl || exit 1
mkdir -p /tmp/sa
printf "import sys; sys.path.insert(0, '%s')\nimport tangram; tangram.__path__.append('%s')\n" $ROOT $ROOT > /tmp/sa/sitecustomize.py
export PYTHONPATH=/tmp/sa:/tmp/site
R=${R:-$OUT/r}
mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee $R/device.txt
