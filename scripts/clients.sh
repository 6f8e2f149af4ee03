#!/usr/bin/env bash
# The real clients the source tests drive (issue 35): util-linux's logger and rsyslog with omrelp;
# and tmux, the real terminal `filechannel top` is driven in (issue 36).
# Installs what is missing when apt-get is there and this runs as root; otherwise says what is
# missing and goes on (the tests that need a missing client skip, naming it). Idempotent and quiet.
# Usage: scripts/clients.sh
set -uo pipefail
missing=()
command -v logger >/dev/null 2>&1 || missing+=(bsdutils)
command -v rsyslogd >/dev/null 2>&1 || missing+=(rsyslog)
command -v tmux >/dev/null 2>&1 || missing+=(tmux)
relp=no
for f in /usr/lib/rsyslog/omrelp.so /usr/lib/*/rsyslog/omrelp.so; do
  [ -e "$f" ] && relp=yes
done
[ "$relp" = yes ] || missing+=(rsyslog-relp)
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
  echo "scripts/clients.sh: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
    apt-get update >/dev/null 2>&1 || true
    apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null 2>&1 ||
      echo "scripts/clients.sh: could not install ${missing[*]}; the tests that need them skip" >&2
  fi
else
  echo "scripts/clients.sh: missing ${missing[*]} (install them as root with apt-get); the tests that need them skip" >&2
fi
exit 0
