#!/usr/bin/env bash
# Checks (and where missing, installs from Adoptium's Debian repository) Temurin 25, the
# second JDK the Java frame tests run (node-agent/tests/java_stacks.rs,
# node-agent/benches/java_cost.rs) beside Debian's OpenJDK 17. Idempotent: instant when
# /usr/lib/jvm/temurin-25-jdk-amd64 is there (the CI image has it); otherwise one apt
# install of about 200 MB.
#
#   scripts/install-temurin.sh
set -euo pipefail
# shellcheck source=scripts/env.sh
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"

HOME_25=/usr/lib/jvm/temurin-25-jdk-amd64
# Adoptium's signing key (https://adoptium.net/installation/linux/).
KEY_FINGERPRINT=3B04D753C9050D9A5D343F39843C48A565F8F04B

if [[ -x "$HOME_25/bin/java" && -x "$HOME_25/bin/javac" ]]; then
  echo "Temurin 25: ok ($("$HOME_25/bin/java" -version 2>&1 | head -1))"
  exit 0
fi
echo "Temurin 25: installing from packages.adoptium.net"
install -d -m 0755 /etc/apt/keyrings
key=/etc/apt/keyrings/adoptium.asc
curl -fsSL https://packages.adoptium.net/artifactory/api/gpg/key/public -o "$key.new"
if ! gpg --show-keys --with-colons "$key.new" | grep -q "^fpr:::::::::$KEY_FINGERPRINT:"; then
  rm -f "$key.new"
  die "the key served by packages.adoptium.net is not Adoptium's ($KEY_FINGERPRINT): not installed"
fi
mv "$key.new" "$key"
codename="$(. /etc/os-release && echo "$VERSION_CODENAME")"
echo "deb [signed-by=$key] https://packages.adoptium.net/artifactory/deb $codename main" \
  > /etc/apt/sources.list.d/adoptium.list
apt-get update -q
apt-get install -y -q --no-install-recommends temurin-25-jdk </dev/null
[[ -x "$HOME_25/bin/javac" ]] || die "temurin-25-jdk installed, but $HOME_25/bin/javac is missing"
