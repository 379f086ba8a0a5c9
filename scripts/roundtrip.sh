#!/usr/bin/env bash
# The main job until the local fleet lands (`fleet up`, next issue): a round trip through the
# registry with the CLI, as a new user would do it, on the embedded store (./.fleet/store or
# $FLEET_STORE). Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
fleet() { .venv/bin/fleet "$@"; }
json() { .venv/bin/python -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
export FLEET_STORE=${FLEET_STORE:-file://./.fleet/store}
model=demo-classifier
example=examples/demo-classifier
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "policies"
fleet policies check policies

step "register $model 1.0.0 and 1.1.0 in $FLEET_STORE"
for version in 1.0.0 1.1.0; do
  if [ "$(fleet models list "$model" --json | json "'$version' in [v['version'] for v in d]")" = True ]; then
    echo "$model:$version already registered"
  else
    fleet models register "$model" "$version" "$example/artifact" --meta "$example/meta.yaml"
  fi
done
fleet models list "$model"

step "tenant demo"
if [ "$(fleet tenants list --json | json "'demo' in [t['name'] for t in d]")" = True ]; then
  echo "tenant demo exists (its key was printed when it was created)"
else
  fleet tenants create demo --model "$model" --rps 20 --burst 40
fi

step "route: 1.0.0 stable, 1.1.0 canary at 10%"
route=$(fleet route show "$model" --json)
if [ "$(echo "$route" | json "d['stable'] is None")" = True ]; then
  fleet route set "$model" --stable 1.0.0 --reason "first rollout (roundtrip)"
fi
if [ "$(echo "$route" | json "d['canary'] is None")" = True ]; then
  fleet route set "$model" --canary 1.1.0 --weight 10 --reason "canary 10% (roundtrip)"
fi
fleet route show "$model"

step "history"
fleet route history "$model"

step "download 1.1.0 and verify every checksum"
dest=$(mktemp -d)/artifact
fleet models fetch "$model" 1.1.0 "$dest"
diff -r "$example/artifact" "$dest" && echo "downloaded files match the registered ones"
rm -rf "$(dirname "$dest")"
