"""YAML that refuses a duplicated key, naming its dotted path and line, and whose booleans are
only `true` and `false`.

yaml.safe_load keeps the last of two equal keys without a word; DVC's parser refuses them, so
draftlab's params files refuse them too: `yaml.load(text, Loader=UniqueKeyLoader)`. PyYAML reads
YAML 1.1, where `yes`, `no`, `on` and `off` are booleans; DVC's parser (YAML 1.2) reads them as
strings, and so does this loader: a boolean key given `yes` is then refused by the params model
(strict booleans) instead of meaning one thing to draftlab and another to `dvc params diff`."""

from __future__ import annotations

import re

import yaml

BOOL_TAG = "tag:yaml.org,2002:bool"
YAML12_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key: str, line: int):
        super().__init__(key)
        self.key, self.line = key, line


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load keeps the last of two equal keys without a word; DVC's parser refuses
    them, so draftlab refuses them too, naming the dotted key and its line."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise DuplicateKey(".".join([*self._path(node), str(key)]), key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def _path(self, target) -> list[str]:
        """Dotted path of a mapping node inside the document (for the message)."""

        def walk(node, trail):
            if node is target:
                return trail
            if isinstance(node, yaml.MappingNode):
                for k, v in node.value:
                    found = walk(v, [*trail, str(k.value)])
                    if found is not None:
                        return found
            return None

        return walk(self._root, []) or []

    def construct_yaml_bool(self, node):
        return self.construct_scalar(node) in ("true", "True", "TRUE")

    def construct_document(self, node):
        self._root = node
        return super().construct_document(node)


# YAML 1.2's booleans only: copy SafeLoader's implicit resolvers without its bool rule, then add ours
UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != BOOL_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
UniqueKeyLoader.add_implicit_resolver(BOOL_TAG, YAML12_BOOL, list("tTfF"))
UniqueKeyLoader.add_constructor(BOOL_TAG, UniqueKeyLoader.construct_yaml_bool)
