#!/usr/bin/env bash
# Usage: bash scripts/gpu_wheels.sh DIR
#
# Run on a machine with PyPI access. This script downloads into DIR the CPython 3.12 manylinux x86_64
# wheels of the maestro_jax runtime dependencies that the GPU image lacks. The image has Python
# 3.12.3 at /opt/torch/.venv/bin/python3 and jax/jaxlib/jax-cuda13-plugin 0.11.2, flax, optax,
# orbax-checkpoint, numpy 2.5.2 ... but no network. The script also downloads the dependencies of
# those wheels that the image lacks. It downloads only dependencies: the project itself travels as
# source. After the download it checks every wheel's Requires-Dist: each requirement must be a wheel
# in DIR (at a matching version) or a package on the image.
#
# How the wheels are used: copy DIR into the repository root as a git-ignored folder (e.g. `.whl/`).
# On the GPU machine, run `bash scripts/gpu_check.sh --wheels .whl --out $OUT/gpu`. That does
#   python3 -m pip install -q --no-index --no-deps --no-compile --target T/site .whl/*.whl
# and puts T/site on PYTHONPATH, so the image's own jax is used and nothing on the image changes.
set -euo pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 DIR" >&2
  exit 2
fi
dir=$1
py=${PYTHON:-python3}

# The only list of what gets downloaded: one version per package, pinned, with who needs it.
# (Image packages that a wheel below requires: absl-py, cloudpickle, etils, numpy, packaging,
# protobuf>=5.28.3 (grain's generated *_pb2.py check it at import), attrs, prometheus-client.)
missing=(
  pydantic==2.14.4          # maestro_jax: config schemas (pyproject: pydantic>=2.9)
  pydantic-core==2.50.5     # pydantic 2.14.4 pins pydantic-core==2.50.5 (compiled, cp312)
  annotated-types==0.8.0    # pydantic: annotated-types>=0.6.0
  typing-inspection==0.4.5  # pydantic: typing-inspection>=0.4.4
  typing-extensions==4.16.0 # pydantic/pydantic-core need >=4.16.0. The image has typing-extensions at an
                            # unknown version; this one is earlier on PYTHONPATH and shadows it (4.x keeps
                            # backward compatibility, so the image's packages still work)
  grain==0.2.18             # maestro_jax: data pipeline (pyproject: grain>=0.2.18; requires only "numpy", no jax)
  array-record==0.8.6       # maestro_jax: record files (pyproject: array-record>=0.5); grain: array-record>=0.8.1
  portpicker==1.6.0         # grain: portpicker (its multiprocessing workers)
  tensorboardX==2.6.5       # maestro_jax: metric logs (pyproject: tensorboardX>=2.6)
  # the gpu extra: tokamax's grouped GEMM for `moe_dispatch: grouped` (models/llm.py grouped_ffn)
  tokamax==0.0.17           # pyproject's gpu extra; needs jax>=0.11.1 (the image has 0.11.2)
  einshape==1.0             # tokamax: einshape
  qwix==0.1.8               # tokamax: qwix>=0.1.2 (needs flax>=0.12, opt_einsum: on the image)
  immutabledict==4.3.1      # tokamax: immutabledict
  xprof==2.24.2             # tokamax: xprof>=2.23.1 (tokamax/_src/benchmarking.py imports xprof.cli.tools
                            # at module level; 32 MB, the largest wheel here)
)
# Requirements of the wheels above that their imports on the GPU never reach, so the check below
# lets them be absent: xprof's profile server (tokamax imports only its kernel-stats tool). Unverified
# until a GPU run: the check's env step imports tokamax and reports what fails.
not_imported="xprof:gviz-api xprof:cheroot xprof:gcsfs xprof:google-cloud-storage xprof:fire xprof:duckdb"

# Packages the GPU image has (/work/.library/device/KINDS.md), with a version where it is known.
# Use this list only to check the wheels' requirements.
image_has="absl-py attrs cloudpickle etils filelock fsspec jax==0.11.2 jaxlib==0.11.2 jax-cuda13-plugin==0.11.2
  jax-cuda13-pjrt==0.11.2 flax optax orbax-checkpoint chex numpy==2.5.2 ml-dtypes msgpack protobuf pyyaml tqdm
  matplotlib pillow safetensors==0.8.0 tensorstore tokenizers==0.23.2 jinja2 typing-extensions packaging
  prometheus-client zipp humanize simplejson psutil tensorboard opt-einsum jaxtyping==0.3.11 wadler-lindig
  werkzeug six urllib3"

mkdir -p "$dir"
"$py" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dir" \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  "${missing[@]}"

# Check DIR: one wheel per package, every wheel cp312/py3 and linux x86_64 or any, and every
# unconditional requirement (markers evaluated for CPython 3.12 on Linux x86_64) met by DIR or the image.
"$py" - "$dir" "$image_has" "$not_imported" "${missing[@]}" <<'EOF'
import re, sys, zipfile, pathlib
try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # the packaging copy that pip ships with
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

wheel_dir, image_has, wanted = pathlib.Path(sys.argv[1]), sys.argv[2].split(), sys.argv[4:]
skipped = {tuple(pair.split(":")) for pair in sys.argv[3].split()}
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
image = {}
for item in image_has:
    name, _, ver = item.partition("==")
    image[canonicalize_name(name)] = ver or None
wanted = {canonicalize_name(w.split("==")[0]): w.split("==")[1] for w in wanted}

have, problems = {}, []
for whl in sorted(wheel_dir.glob("*.whl")):
    name, ver, _, tags = parse_wheel_filename(whl.name)
    if name in have:
        problems.append(f"two wheels of {name}: {have[name][0]} and {ver}")
    bad = [t for t in tags if t.interpreter not in ("cp312", "py3") or
           not (t.platform == "any" or (t.platform.startswith("manylinux") and t.platform.endswith("x86_64")))]
    if bad:
        problems.append(f"{whl.name}: not a CPython 3.12 linux x86_64 wheel")
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        reqs = [Requirement(line.split(":", 1)[1].strip()) for line in z.read(meta).decode().splitlines()
                if line.startswith("Requires-Dist:")]
    have[name] = (str(ver), reqs)
for name, ver in wanted.items():
    if name not in have:
        problems.append(f"{name}=={ver} was not downloaded")
    elif have[name][0] != ver:
        problems.append(f"{name}: wanted {ver}, got {have[name][0]}")
for name, (ver, reqs) in sorted(have.items()):
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an extra, or another platform
        dep = canonicalize_name(req.name)
        if (name, dep) in skipped:
            print(f"  {name} {ver} -> {req}: not imported on the GPU (not_imported)")
            continue
        if dep in have:
            where, dep_ver = "in DIR", have[dep][0]
        elif dep in image:
            where, dep_ver = "on the image", image[dep]
        else:
            problems.append(f"{name} {ver} requires {req}: neither in DIR nor on the image")
            continue
        if dep_ver is not None and not req.specifier.contains(dep_ver, prereleases=True):
            problems.append(f"{name} {ver} requires {req}, but {dep} {dep_ver} is {where}")
        print(f"  {name} {ver} -> {req}: {where}" + (f" ({dep_ver})" if dep_ver else ""))
if problems:
    sys.exit("gpu_wheels.sh: " + "\n  ".join(["problems:"] + problems))
print(f"{len(have)} wheels in {wheel_dir}, requirements met: " + ", ".join(f"{n} {v}" for n, (v, _) in sorted(have.items())))
EOF
