#!/usr/bin/env python3
"""Validates rendered Kubernetes manifests (multi-document YAML) offline.

Istio resources are checked against the openAPIV3Schema of Istio's CRDs in
envoy/istio/schemas/ (unknown fields rejected, as the API server's strict
field validation does); every other resource against the Kubernetes schemas
of the kubernetes-validate package, strictly. Exits non-zero, naming each
resource and problem, if anything is invalid or of an unknown kind.

    kubectl kustomize envoy/istio/overlays/sidecar | python3 envoy/istio/validate.py -
"""

import argparse
import copy
import pathlib
import sys

import jsonschema
import kubernetes_validate
import yaml

SCHEMAS = pathlib.Path(__file__).resolve().parent / "schemas"
KUBERNETES_VERSION = "1.32.0"


def strict(schema):
    """Rejects fields a structural schema does not declare, unless it keeps unknown fields."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def load_crds():
    """(group, version, kind) -> the strict openAPIV3Schema of that CRD version."""
    crds = {}
    for path in sorted(SCHEMAS.glob("*.crd.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if not version.get("served"):
                    continue
                schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
                crds[(spec["group"], version["name"], spec["names"]["kind"])] = strict(schema)
    return crds


def name_of(doc):
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind')}/{meta.get('name')}"


def check(doc, crds):
    """The problems of one resource, as strings."""
    api_version = doc.get("apiVersion", "")
    kind = doc.get("kind", "")
    if not api_version or not kind:
        return ["no apiVersion or kind"]
    meta = doc.get("metadata")
    if not isinstance(meta, dict) or not meta.get("name"):
        return ["no metadata.name"]
    group, _, version = api_version.rpartition("/")
    if group.endswith("istio.io"):
        schema = crds.get((group, version, kind))
        if schema is None:
            return [f"no CRD schema for {api_version} {kind}"]
        body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
        validator = jsonschema.Draft7Validator(schema)
        return [
            f"{'.'.join(str(p) for p in err.absolute_path) or '(root)'}: {err.message}"
            for err in sorted(validator.iter_errors(body), key=lambda e: list(e.absolute_path))
        ]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = ".".join(str(p) for p in err.path) or "(root)"
        return [f"{path}: {err.message}"]
    except kubernetes_validate.SchemaNotFoundError:
        return [f"no Kubernetes {KUBERNETES_VERSION} schema for {api_version} {kind}"]
    return []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="YAML files, or - for stdin")
    args = parser.parse_args()
    crds = load_crds()
    failed = False
    count = 0
    for file in args.files:
        text = sys.stdin.read() if file == "-" else pathlib.Path(file).read_text()
        for doc in yaml.safe_load_all(text):
            if doc is None:
                continue
            count += 1
            for problem in check(doc, crds):
                print(f"{file}: {name_of(doc)}: {problem}", file=sys.stderr)
                failed = True
    if count == 0:
        print("no resources to validate", file=sys.stderr)
        return 1
    if failed:
        return 1
    print(f"{count} resources valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
