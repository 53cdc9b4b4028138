#!/bin/sh
# Writes the compose stack's secrets into ./secrets (mode 600): the controller's credentials,
# one client credential for service `payments` (and its secret alone, for the sidecar), the zone-report secret, Postgres' password, the
# controller replicas' database URL, and rlc's environment (API token, controller token,
# PGPASSWORD, GIT_TOKEN left empty).
# usage: deploy/compose/secrets.sh GRL   (GRL: the grl binary, e.g. target/release/grl)
set -eu
grl=$1
cd "$(dirname "$0")"
umask 077
mkdir -p secrets
"$grl" gen-credential --name rlc --scope config,reports > secrets/controller-credentials
"$grl" gen-credential --name oncall --scope overrides >> secrets/controller-credentials
"$grl" gen-credential --name zone --scope zone-report >> secrets/controller-credentials
"$grl" gen-credential --name payments --scope payments > secrets/client-credentials
awk '$1=="zone"{print $3}' secrets/controller-credentials > secrets/zone-token
awk '$1=="payments"{print $3}' secrets/client-credentials > secrets/payments-client-token
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > secrets/pg-password
echo "postgres://rlc:$(cat secrets/pg-password)@postgres:5432/rlc" > secrets/controller-database-url
{
    echo "RLC_TOKEN=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
    echo "GRL_CONFIG_TOKEN=$(awk '$1=="rlc"{print $3}' secrets/controller-credentials)"
    echo "PGPASSWORD=$(cat secrets/pg-password)"
    echo "GIT_TOKEN="
} > secrets/rlc.env
