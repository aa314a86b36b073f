#!/usr/bin/env bash
# The README's path without make, run as written in a fresh virtual environment (the
# <!-- install-check --> block, with its .venv and paddle package replaced), then what a
# user does next. It fails unless:
#   - the runtime dependencies and the package import from outside the source tree,
#     the package from the environment's site-packages;
#   - examples/generate.py (in the block) runs;
#   - no file but our op library carries Paddle's _pd_ suffix and no egg but ours exists
#     (Paddle's installer renames the native modules of every egg it installs), and no
#     version.txt (Paddle's build record) lands at the top of site-packages;
#   - python -m paddle_step.serve answers /health.
#
#   .ci/install_check.sh VENV PADDLE_PACKAGE    e.g. .venv-install paddlepaddle==3.3.1
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:?usage: .ci/install_check.sh VENV PADDLE_PACKAGE}
paddle_package=${2:?usage: .ci/install_check.sh VENV PADDLE_PACKAGE}
name=$(basename "$venv")

block=$(sed -n '/^<!-- install-check -->$/,/^```$/p' README.md | sed '1,2d;$d')
if [ -z "$block" ]; then
  echo "install-check: README.md has no <!-- install-check --> block"
  exit 1
fi
block=${block//.venv\//$venv/}
block=${block//python3 -m venv .venv/python3 -m venv $venv}
block=${block//paddlepaddle==3.3.1/$paddle_package}

# A fresh clone has neither: an old build/ could hand setup_ops.py another paddle's library.
rm -rf "$venv" build python/*.egg-info
mkdir -p build
log=build/install-check-$name.log
echo "install-check ($name): running the README's lines, log in $log:"
echo "$block" | sed 's/^/    /'
start=$SECONDS
if ! bash -euxc "$block" >"$log" 2>&1; then
  tail -n 60 "$log"
  echo "install-check ($name): the README's lines failed"
  exit 1
fi
echo "install-check ($name): the README's lines ran in $((SECONDS - start)) s"
tail -n 3 "$log"

python=$(cd "$venv" && pwd)/bin/python
outside=$(mktemp -d)
trap 'rm -rf "$outside"' EXIT
(cd "$outside" && "$python" - <<'EOF'
import pathlib
import sysconfig

import jinja2  # noqa: F401
import safetensors  # noqa: F401
import tokenizers  # noqa: F401

import paddle_step
import paddle_step_ops

site = {pathlib.Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")}
where = pathlib.Path(paddle_step.__file__).resolve()
assert any(root.resolve() in where.parents for root in site), f"paddle_step from {where}"
ours = "paddle_step_ops"
assert "step_paddle" in dir(paddle_step_ops), dir(paddle_step_ops)
foreign = sorted(
    str(path)
    for root in site
    for path in root.rglob("*_pd_*")
    if not path.name.startswith(ours)
)
assert not foreign, f"files renamed by Paddle's installer: {foreign}"
eggs = sorted(
    path.name for root in site for path in root.glob("*.egg") if not path.name.startswith(ours)
)
assert not eggs, f"eggs installed: {eggs}"
# Paddle's build record (the compile flags) stays in the build folder.
records = sorted(str(root / "version.txt") for root in site if (root / "version.txt").exists())
assert not records, f"build records installed: {records}"
print(f"install-check: imports from {where.parent}; no foreign _pd_ file, egg or build record")
EOF
)

start=$SECONDS
(cd "$outside" && "$python" - <<'EOF'
from paddle_step.testing.server_process import server_process

with server_process(timeout_s=300) as url:
    print(f"install-check: python -m paddle_step.serve answered {url}/health")
EOF
)
echo "install-check ($name): the server started in $((SECONDS - start)) s"
