"""Render deploy/k8s's kustomizations offline: the part of kustomize those files use, and nothing else.

``kubectl`` is not available to the tests, so this reproduces what ``kubectl apply -k DIR`` renders for the
features deploy/k8s uses, and refuses every other one (a kustomization that starts using another feature fails
here rather than being rendered differently from kustomize):

- ``resources``: files (multi-document YAML) and directories (another kustomization), in order;
- ``patches`` with a ``target`` (group, version, kind, name, namespace) and a JSON 6902 patch file (a YAML list
  of ``add`` / ``replace`` / ``remove`` operations, RFC 6902 semantics). Stricter than kustomize: a target must
  match exactly one resource, so a renamed resource cannot leave a patch silently unapplied;
- ``images``: ``name`` → ``newName`` / ``newTag`` / ``digest`` on every ``image`` of an item of a list named
  ``containers`` or ``initContainers`` at any depth (kustomize's legacy image filter: a pod template's containers,
  a PyTorchJob's replica templates), and on the fields that ``configurations`` files declare under ``images``
  (``path`` and ``kind``: a TrainJob's ``spec/trainer/image``), whose image name (before ``:tag`` / ``@digest``)
  equals ``name``. Applied after the patches, as kustomize's transformer order does.

Two resources with the same apiVersion group, kind, namespace and name are an error, as in kustomize.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "patches", "images", "configurations"}
TARGET_FIELDS = {"group", "version", "kind", "name", "namespace"}


class RenderError(ValueError):
    pass


def render(directory: Path) -> list[dict]:
    """The resources ``kubectl apply -k directory`` would apply, in order."""
    kfile = directory / "kustomization.yaml"
    k = yaml.safe_load(kfile.read_text())
    unknown = set(k) - SUPPORTED_FIELDS
    if unknown:
        raise RenderError(f"{kfile}: expected only {sorted(SUPPORTED_FIELDS)}, got {sorted(unknown)}")
    if k.get("kind") != "Kustomization":
        raise RenderError(f"{kfile}: expected kind Kustomization, got {k.get('kind')!r}")
    docs: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    _check_unique(docs, kfile)
    for patch in k.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text())
        if not isinstance(ops, list):
            raise RenderError(
                f"{patch['path']}: expected a JSON 6902 operation list, got {type(ops).__name__}"
            )
        target = patch.get("target") or {}
        if set(target) - TARGET_FIELDS:
            raise RenderError(
                f"{kfile}: expected target fields {sorted(TARGET_FIELDS)}, got {sorted(target)}"
            )
        matched = [d for d in docs if _matches(d, target)]
        if len(matched) != 1:
            raise RenderError(
                f"{kfile}: patch {patch['path']} target {target} matched {len(matched)} resources"
            )
        for op in ops:
            apply_operation(matched[0], op)
    field_specs = []
    for name in k.get("configurations", []):
        config = yaml.safe_load((directory / name).read_text())
        if set(config) != {"images"} or any(set(f) - {"path", "kind"} for f in config["images"]):
            raise RenderError(f"{name}: expected only `images` field specs with path and kind, got {config}")
        field_specs += config["images"]
    for image in k.get("images", []):
        _set_image(docs, image, field_specs)
    return docs


def _group_version(doc: dict) -> tuple[str, str]:
    group, _, version = doc["apiVersion"].rpartition("/")
    return group, version


def _matches(doc: dict, target: dict) -> bool:
    group, version = _group_version(doc)
    have = {
        "group": group,
        "version": version,
        "kind": doc.get("kind"),
        "name": doc.get("metadata", {}).get("name"),
        "namespace": doc.get("metadata", {}).get("namespace"),
    }
    return all(have[k] == v for k, v in target.items())


def _check_unique(docs: list[dict], where: Path) -> None:
    seen = set()
    for d in docs:
        key = (_group_version(d)[0], d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"])
        if key in seen:
            raise RenderError(f"{where}: resource {key} appears twice")
        seen.add(key)


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise RenderError(f"expected a JSON pointer starting with '/', got {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def apply_operation(doc: Any, op: dict) -> None:
    """One RFC 6902 ``add``, ``replace`` or ``remove``, in place."""
    kind = op.get("op")
    if kind not in ("add", "replace", "remove"):
        raise RenderError(f"expected op add, replace or remove, got {kind!r}")
    *parents, last = _pointer(op["path"])
    node = doc
    for part in parents:
        try:
            node = node[int(part)] if isinstance(node, list) else node[part]
        except (KeyError, IndexError, ValueError):
            raise RenderError(f"{op['path']}: no {part!r} to descend into") from None
    value = copy.deepcopy(op.get("value"))
    if isinstance(node, list):
        if kind == "add" and last == "-":
            node.append(value)
            return
        try:
            index = int(last)
        except ValueError:
            raise RenderError(f"{op['path']}: expected an array index, got {last!r}") from None
        if not 0 <= index < len(node) + (kind == "add"):
            raise RenderError(f"{op['path']}: index {index} outside an array of {len(node)}")
        if kind == "add":
            node.insert(index, value)
        elif kind == "replace":
            node[index] = value
        else:
            del node[index]
        return
    if not isinstance(node, dict):
        raise RenderError(f"{op['path']}: expected an object or array, got {type(node).__name__}")
    if kind in ("replace", "remove") and last not in node:
        raise RenderError(f"{op['path']}: {kind} of a member that does not exist")
    if kind == "remove":
        del node[last]
    else:
        node[last] = value


def _image_holders(node: Any, under_containers: bool = False):
    """``(mapping, "image")`` for every ``image`` of an item of a ``containers``/``initContainers`` list."""
    if isinstance(node, dict):
        if under_containers and isinstance(node.get("image"), str):
            yield node, "image"
        for key, value in node.items():
            yield from _image_holders(
                value, key in ("containers", "initContainers") and isinstance(value, list)
            )
    elif isinstance(node, list):
        for item in node:
            yield from _image_holders(item, under_containers)


def _declared_holders(doc: dict, field_specs: list[dict]):
    for spec in field_specs:
        if spec.get("kind", doc.get("kind")) != doc.get("kind"):
            continue
        *parents, last = spec["path"].split("/")
        node = doc
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(last), str):
            yield node, last


def _set_image(docs: list[dict], image: dict, field_specs: list[dict] = ()) -> None:
    for doc in docs:
        for holder, key in [*_image_holders(doc), *_declared_holders(doc, list(field_specs))]:
            name, tag, digest = split_image(holder[key])
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            if "digest" in image:
                holder[key] = f"{name}@{image['digest']}"
            else:
                tag = image.get("newTag", tag)
                holder[key] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def split_image(ref: str) -> tuple[str, str, str]:
    """``"registry:5000/a/b:1.0@sha256:…"`` → (``"registry:5000/a/b"``, ``"1.0"``, ``"sha256:…"``)."""
    ref, _, digest = ref.partition("@")
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        return ref[:colon], ref[colon + 1 :], digest
    return ref, "", digest


def record_parsed_options(monkeypatch) -> set[str]:
    """Every option string of each argparse parser that parses from now on (the set fills as they parse): the
    manifests' flags are checked against the flags the real parsers know."""
    import argparse

    options: set[str] = set()
    real_parse = argparse.ArgumentParser.parse_args

    def recording_parse(self, *args, **kwargs):
        options.update(self._option_string_actions)
        return real_parse(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", recording_parse)
    return options
