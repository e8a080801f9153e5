#!/usr/bin/env bash
# Certificates for the compose demo mesh: one mesh CA, one certificate per site, one
# for the coordinator and one for the operator.
#
#   docker/make-certs.sh               # the CA (once), site-a..c, coordinator, operator
#   docker/make-certs.sh site-d        # one more site from the same CA (compose.join.yaml)
#
# Writes, under docker/ (or $GOSSIPD_COMPOSE_DIR), all ignored by git and by the build:
#   certs/ca/ca.pem, certs/ca/ca.key     the mesh CA; never mounted into a container
#   certs/SITE/ca.pem, SITE.pem, SITE.key   what compose mounts at /etc/gossipd/certs of SITE
#   certs/coordinator/ca.pem, coordinator.pem, coordinator.key   the same for the
#                                        coordinator: a coordinator certificate
#                                        (gossipd certs issue --coordinator), never a site's
#   certs/operator/ca.pem, operator.pem, operator.key   the operator's certificate
#                                        (gossipd certs issue --operator): it signs control
#                                        commands (gossipd control), which checks the sites'
#                                        signed replies against ca.pem; mounted read-only into a one-off
#                                        `compose run` only, never into a site or the
#                                        coordinator (docs/containers.md)
#   .env                                 GOSSIPD_UID=<your uid>: the image's user then owns
#                                        what you own, so it can read SITE.key (mode 0600)
#                                        and operator.key
# A site (or the coordinator, or the operator) that already has certs/NAME/ is kept;
# delete that directory to issue anew.
# Needs `gossipd` on PATH (README "Install").
set -euo pipefail

out="${GOSSIPD_COMPOSE_DIR:-$(cd "$(dirname "$0")" && pwd)}"
mesh_id="compose-demo"
default_uid=10001   # the image's default user (docker/Dockerfile ARG GOSSIPD_UID)
coordinator="coordinator"   # the coordinator service's name, and its certificate's
operator="operator"         # the operator's certificate: no service runs with it
if [ "$#" -gt 0 ]; then
  sites=("$@")
else
  sites=(site-a site-b site-c "$coordinator" "$operator")
fi

ca_dir="$out/certs/ca"
if [ ! -e "$ca_dir/ca.pem" ]; then
  gossipd certs init --dir "$ca_dir" --mesh-id "$mesh_id"
fi

for site in "${sites[@]}"; do
  site_dir="$out/certs/$site"
  if [ -e "$site_dir" ]; then
    echo "$site: kept $site_dir (delete it to issue a new certificate)"
    continue
  fi
  case "$site" in
    "$coordinator") gossipd certs issue "$site" --coordinator --dir "$ca_dir" ;;
    "$operator") gossipd certs issue "$site" --operator --dir "$ca_dir" ;;
    *) gossipd certs issue "$site" --dir "$ca_dir" ;;
  esac
  mkdir -p "$site_dir"
  # Each gets the CA certificate, its own certificate and key; the CA dir keeps
  # neither the key nor the certificate. The operator checks the sites' signed replies
  # against the CA certificate.
  cp "$ca_dir/ca.pem" "$site_dir/"
  mv "$ca_dir/$site.pem" "$ca_dir/$site.key" "$site_dir/"
  if [ "$(id -u)" -eq 0 ]; then
    # root owns everything; the image's user cannot read a root-owned 0600 key (the
    # operator's included: `compose run` signs with it as that user).
    chown -R "$default_uid" "$site_dir"
  fi
done

if [ "$(id -u)" -ne 0 ]; then
  echo "GOSSIPD_UID=$(id -u)" >"$out/.env"
  echo "wrote $out/.env (GOSSIPD_UID=$(id -u): the containers run as you and read your keys)"
fi
